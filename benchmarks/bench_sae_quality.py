"""SAE quality at equal L0, dictionary size and token budget: our trainer with its shipped
defaults against EleutherAI sparsify and SAELens with theirs (when installed: the
``baselines`` extra), on MiniLM's layer-0 query input for the demo corpus, split by text
90/10. Every SAE is scored by one evaluator (``sae.evaluate.evaluate_sae``) on the
held-out texts, and turned into a LUT for the query layer whose relative error is measured
on the same texts.

    python -m benchmarks sae_quality            # SAE_QUALITY_DATA=dataset dir to reuse one

Each trainer sees the same batches (our loader, same seed) and its own initialisation and
optimiser defaults: ours (Adam with betas 0.8/0.98 — and, for comparison, 0.9/0.999 —,
lr 2.8e-3/sqrt(n/16384), warm-up 5 %, decay 20 %,
geometric-median b_dec, AuxK); sparsify's ``Trainer`` step (Signum in ScheduleFree,
lr 5e-3/sqrt(n/2^14), mean b_dec, no AuxK); SAELens' ``SAETrainer`` (``TopKTrainingSAE``,
Adam 3e-4 constant).
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from .common import table

N_LATENTS, K, BATCH, EPOCHS, SEEDS = 3072, 32, 4096, 4, (0, 1)
HOOK = "encoder.layer.0.attention.self.query:input"
LAYER = "encoder.layer.0.attention.self.query"
CACHE = Path(__file__).resolve().parent.parent / "out" / "bench_sae_quality"


def activations() -> Path:
    """The demo corpus' layer-0 query inputs as a token dataset with ``sample_id``."""
    given = os.environ.get("SAE_QUALITY_DATA")
    if given:
        return Path(given)
    root = CACHE / "activations"
    if (root / "dataset_manifest.json").is_file():
        return root
    from pyspark_safetensors.dataset import write_batch_dataset
    from pyspark_safetensors.extract import Extractor, default_model_dir, demo_passages

    texts = sorted({t for _, t in demo_passages()})
    windows = Extractor(default_model_dir(), [HOOK], max_length=128, dtype="F32").run(texts)
    acts = np.concatenate([w.activations[HOOK] for w in windows])
    ids = np.concatenate([np.full(w.seq_len, w.text_index, np.int64) for w in windows])
    write_batch_dataset(root, {"activation": acts, "sample_id": ids},
                        metadata={"hook_point": HOOK})  # fmt: skip
    return root


def _loader(train: Path, seed: int):
    from pyspark_safetensors.torch import ActivationLoader, open_dataset

    return ActivationLoader(open_dataset(train), BATCH, columns=["activation"], seed=seed,
                            drop_last=True, dp_rank=0, dp_size=1)  # fmt: skip


def _batches(train: Path, seed: int, steps: int):
    loader, done = _loader(train, seed), 0
    while done < steps:
        for batch in loader:
            yield batch["activation"]
            done += 1
            if done == steps:
                return


def train_ours(train: Path, val: Path, seed: int, steps: int, out: Path, **overrides) -> Path:
    from pyspark_safetensors.sae import SAEConfig
    from pyspark_safetensors.sae.train import Trainer

    config = SAEConfig(dataset=str(train), n_latents=N_LATENTS, k=K, batch_size=BATCH,
                       tokens=steps * BATCH, seed=seed, out_dir=str(out), checkpoints=0,
                       progress=False, log_every=1000, **overrides)  # fmt: skip
    Trainer(config).fit()
    return out / "sae.safetensors"


def train_ours_adam_defaults(train: Path, val: Path, seed: int, steps: int, out: Path) -> Path:
    """Ours with Adam's textbook betas (0.9, 0.999), the defaults before (0.8, 0.98)."""
    return train_ours(train, val, seed, steps, out, adam_betas=(0.9, 0.999))


def train_sparsify(train: Path, val: Path, seed: int, steps: int, out: Path) -> Path:
    from schedulefree import ScheduleFreeWrapper
    from sparsify import SparseCoder, SparseCoderConfig
    from sparsify.sign_sgd import SignSGD

    torch.manual_seed(seed)
    sae = SparseCoder(384, SparseCoderConfig(num_latents=N_LATENTS, k=K), device="cpu")
    lr = 5e-3 / (N_LATENTS / 2**14) ** 0.5  # sparsify's default for its default optimiser
    opt = ScheduleFreeWrapper(SignSGD([{"params": sae.parameters(), "lr": lr}]), momentum=0.95)
    opt.train()
    for step, x in enumerate(_batches(train, seed, steps)):
        if step == 0:
            sae.b_dec.data = x.mean(0)
        sae.set_decoder_norm_to_unit_norm()
        out_ = sae(x)
        out_.fvu.backward()
        sae.remove_gradient_parallel_to_decoder_directions()
        opt.step()
        opt.zero_grad()
    opt.eval()  # ScheduleFree: the averaged weights are the model
    sae.set_decoder_norm_to_unit_norm()
    sae.save_to_disk(out)
    return out


def train_saelens(train: Path, val: Path, seed: int, steps: int, out: Path) -> Path:
    from sae_lens import TopKTrainingSAE, TopKTrainingSAEConfig
    from sae_lens.config import SAETrainerConfig
    from sae_lens.training.sae_trainer import SAETrainer

    torch.manual_seed(seed)
    sae = TopKTrainingSAE(TopKTrainingSAEConfig(d_in=384, d_sae=N_LATENTS, k=K))
    # the runner config's defaults: lr 3e-4 constant, lr_end = lr / 10 (unused when constant)
    cfg = SAETrainerConfig(total_training_samples=steps * BATCH, train_batch_size_samples=BATCH,
                           lr=3e-4, lr_end=3e-5)  # fmt: skip
    SAETrainer(cfg, sae, iter(_batches(train, seed, steps))).fit()
    sae.save_inference_model(out)
    return out


HEADER = ["trainer", "seed", "held-out FVU", "L0", "dead", "dense (>10 %)", "train tokens/s",
          "LUT rel. L2"]  # fmt: skip
TRAINERS = {
    "ours (defaults)": train_ours,
    "ours (Adam betas 0.9/0.999, the previous defaults)": train_ours_adam_defaults,
    "sparsify": train_sparsify,
    "SAELens": train_saelens,
}
NEEDS = {"sparsify": "sparsify", "SAELens": "sae_lens"}


def lut_error(sae_path: Path, x: torch.Tensor, *, fold: bool = True) -> float:
    """Relative L2 error of the query layer's LUT (k = K, no compensation) on ``x``."""
    from pyspark_safetensors.extract import default_model_dir
    from pyspark_safetensors.lut import evaluate_layer, load_layer_file, precompute_lut
    from pyspark_safetensors.lut.precompute import ModelWeights
    from pyspark_safetensors.sae import read_sae

    with tempfile.TemporaryDirectory() as tmp:
        precompute_lut(default_model_dir(), {LAYER: sae_path}, out_dir=Path(tmp) / "lut",
                       progress=False)  # fmt: skip
        tensors = load_layer_file(Path(tmp) / "lut" / f"{LAYER}.lut.safetensors")
    if not fold:  # what the LUT stored before b_enc - W_enc b_dec was folded in
        tensors["encoder_bias"] = read_sae(sae_path)[0]["encoder_bias"].half().float()
    weight = ModelWeights(default_model_dir()).weight(LAYER)
    (row,) = evaluate_layer(tensors, weight, x, ks=[K], ms=[0])
    return row["rel_l2"]


def run() -> str:
    import importlib.util

    from pyspark_safetensors.sae import load_sae_model
    from pyspark_safetensors.sae.evaluate import evaluate_sae, held_out_batches, split_by_sample

    data = activations()
    split = CACHE / "split"
    if not (split / "val" / "dataset_manifest.json").is_file():
        split_by_sample(data, split, val_fraction=0.1, seed=0)
    train, val = split / "train", split / "val"
    steps = EPOCHS * len(_loader(train, 0))
    x_val = torch.cat(list(held_out_batches(val)))
    rows, missing = [], []
    for name, fn in TRAINERS.items():
        if name in NEEDS and importlib.util.find_spec(NEEDS[name]) is None:
            missing.append(name)
            continue
        for seed in SEEDS:
            with tempfile.TemporaryDirectory() as tmp:
                started = time.perf_counter()
                path = fn(train, val, seed, steps, Path(tmp) / "sae")
                seconds = time.perf_counter() - started
                sae = load_sae_model(path, k=K)
                m = evaluate_sae(sae, held_out_batches(val))
                extra = ""
                if name.startswith("ours"):
                    extra = f" (unfolded: {lut_error(path, x_val[:8192], fold=False):.3f})"
                rows.append([
                    name, seed, f"{m['fvu']:.4f}", f"{m['l0']:.1f}",
                    f"{m['dead_fraction']:.1%}", f"{m['dense_fraction']:.1%}",
                    f"{steps * BATCH / seconds:,.0f}",
                    f"{lut_error(path, x_val[:8192]):.3f}{extra}",
                ])  # fmt: skip
            print(rows[-1], flush=True)
    note = f" Not installed, so not measured: {', '.join(missing)}." if missing else ""
    return (
        f"Held-out quality at equal budget: {N_LATENTS} latents, k = {K}, batch {BATCH}, "
        f"{steps} steps = {steps * BATCH:,} training tokens ({EPOCHS} epochs of the 90 % of "
        f"texts), evaluated on the other {len(x_val):,} tokens (10 % of the texts). "
        f"LUT error: query layer, k = {K}, no compensation, first 8,192 held-out tokens; "
        f"for ours also with the encoder bias the LUT stored before the fold.{note}\n\n"
        + table(HEADER, rows)
    )
