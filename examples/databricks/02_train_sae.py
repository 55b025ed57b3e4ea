# Databricks notebook source
# MAGIC %md
# MAGIC # A sparse autoencoder on the activations
# MAGIC
# MAGIC Trains a small TopK SAE on the driver from the dataset `01_write_and_query_activations`
# MAGIC wrote (the same `root` widget), then shows its training curves and latent firing
# MAGIC frequencies. The trainer reads the shards by path; no Spark job runs here. On a
# MAGIC GPU cluster it trains on the GPU.

# COMMAND ----------

# MAGIC %pip install pyspark-safetensors[torch]

# COMMAND ----------

dbutils.widgets.text("root", "/Volumes/main/default/pyspark_safetensors", "Output directory")
root = dbutils.widgets.get("root").rstrip("/")
acts_path, sae_dir = f"{root}/acts", f"{root}/sae"

# COMMAND ----------

# MAGIC %md
# MAGIC The dataset as torch sees it: one row per token, tensors by column.

# COMMAND ----------

from pyspark_safetensors.torch import open_dataset

acts = open_dataset(acts_path)
print(len(acts), "tokens; activation", tuple(acts[0]["activation"].shape))

# COMMAND ----------

# MAGIC %md
# MAGIC ## Train
# MAGIC
# MAGIC 64 latents, 4 active per token, 64 steps of 128 tokens (two passes): a toy of a few
# MAGIC seconds. For real activations raise `n_latents` (or `expansion_factor`), `k` and
# MAGIC `tokens` (`docs/sae.md` lists every field). The run goes to the driver's local disk
# MAGIC (it appends to its log as it trains, which a Volume does not take) and is copied to
# MAGIC the Volume when it is done.

# COMMAND ----------

import shutil
import tempfile

from pyspark_safetensors.sae import SAEConfig
from pyspark_safetensors.sae.train import Trainer

local_run = tempfile.mkdtemp(prefix="sae-")
config = SAEConfig(
    dataset=acts_path,
    n_latents=64,
    k=4,
    batch_size=128,
    tokens=8192,
    out_dir=local_run,
    progress=False,
)
metrics = Trainer(config).fit()
shutil.copytree(local_run, sae_dir, dirs_exist_ok=True)
shutil.rmtree(local_run)
print({name: round(value, 4) for name, value in metrics.items() if isinstance(value, float)})

# COMMAND ----------

# MAGIC %md
# MAGIC ## Plots
# MAGIC
# MAGIC The trainer draws `training.png` (loss, FVU and dead latents over tokens) and
# MAGIC `latent_frequency.png` (how often each latent fires) into its run directory, now on
# MAGIC the Volume.

# COMMAND ----------

import matplotlib.image as mpimg
import matplotlib.pyplot as plt

for name in ("training.png", "latent_frequency.png"):
    image = mpimg.imread(f"{sae_dir}/{name}")
    figure, axes = plt.subplots(figsize=(12, 12 * image.shape[0] / image.shape[1]))
    axes.imshow(image)
    axes.set_axis_off()
    plt.show()

# COMMAND ----------

# MAGIC %md
# MAGIC ## Use the SAE
# MAGIC
# MAGIC The trained SAE encodes activations into `k` latents per token and decodes them back.

# COMMAND ----------

import torch

from pyspark_safetensors.sae import load_sae_model

sae = load_sae_model(sae_dir)
x = torch.stack([acts[i]["activation"] for i in range(8)]).float()
with torch.no_grad():
    values, indices = sae.encode(x)  # [8, k] each: the active latents and their values
    x_hat = sae.decode(values, indices)
print("latents of token 0:", indices[0].tolist())
print("FVU on these tokens:", float(((x - x_hat) ** 2).sum() / ((x - x.mean(0)) ** 2).sum()))
