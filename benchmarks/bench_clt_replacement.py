"""The whole network replaced: a cross-layer transcoder against per-layer transcoders at
equal tokens and equal total latents, and the CLT's two losses (``clt_loss``), on the
toy Llama of ``conf/pipeline-clt.toml`` (``TOY``: 4 layers, hidden 64, 600 steps; it holds
out 64 passages here, trained here once and cached under the temporary directory).

    python -m benchmarks clt_replacement
    CLT_REPLACEMENT_K=8 python -m benchmarks clt_replacement

Every layer's MLP input and output is captured by the extraction's ``Extractor`` (BOS
dropped) from the model's training passages, and from its held-out passages for the
held-out FVU. For each k (``CLT_REPLACEMENT_K``, default 8 and 16) it trains a transcoder
per block, a CLT with the per-layer loss (the sum of the layers' FVUs) and a CLT with the
pooled loss (every layer's error over the layers' total variance), each of ``N_LATENTS``
latents and k per layer, batch ``BATCH``, ``EPOCHS`` passes over the training tokens, the
trainer's defaults otherwise, one process. Each then replaces every MLP of the model at
once on the held-out passages (``circuits.replacement_evaluation``, each code the top k
per layer per token): CE loss recovered against every MLP zero-ablated, KL to the clean
next-token distributions, top-1 agreement. Beside it, each layer's share of the MLP
outputs' variance: an error weighs in the residual stream by its size, whichever layer
made it.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from .common import table

N_LATENTS, BATCH, EPOCHS = 256, 1024, 4


def _toy():
    from pyspark_safetensors.extract.toy_lm import ToyLMConfig

    return ToyLMConfig(num_layers=4, hidden_size=64, intermediate_size=192, num_heads=4,
                       num_kv_heads=2, vocab_size=1024, context=64, steps=600,
                       learning_rate=0.005, warmup_steps=30, held_out_texts=64)  # fmt: skip


def _datasets(paths, t: int | None = None) -> dict:
    """The trainer's datasets: every layer's (a CLT) or layer ``t``'s (a transcoder)."""
    if t is None:
        return {"datasets": tuple(paths["train_x"]), "target_datasets": tuple(paths["train_y"]),
                "val_datasets": tuple(paths["val_x"]),
                "val_target_datasets": tuple(paths["val_y"])}  # fmt: skip
    return {"dataset": paths["train_x"][t], "target_dataset": paths["train_y"][t],
            "val_dataset": paths["val_x"][t], "val_target_dataset": paths["val_y"][t]}  # fmt: skip


def _train(out: Path, common: dict, **kw):
    from pyspark_safetensors.sae import SAEConfig
    from pyspark_safetensors.sae.train import Trainer

    trainer = Trainer(SAEConfig(out_dir=str(out), **common, **kw))
    metrics = trainer.fit()
    return trainer.sae.eval(), metrics


def _dictionaries(paths, tmp: Path, k: int, tokens: int, layers: int):
    """{name: (replacement maker, held-out FVU per layer, seconds)} for one k."""
    from pyspark_safetensors.circuits.replacement import clt_replacement, transcoder_replacement

    common = dict(n_latents=N_LATENTS, k=k, batch_size=BATCH, tokens=tokens, checkpoints=0,
                  progress=False, plots=False, log_every=10_000)  # fmt: skip
    out = {}
    started = time.perf_counter()
    per_layer = [_train(tmp / f"k{k}-t{t}", common, architecture="transcoder",
                        **_datasets(paths, t)) for t in range(layers)]  # fmt: skip
    blocks = [f"model.layers.{t}.mlp" for t in range(layers)]
    saes = {block: sae for block, (sae, _) in zip(blocks, per_layer, strict=True)}
    out["per-layer transcoders"] = (
        lambda m, s=saes: transcoder_replacement(m, s),
        [m["val_fvu"] for _, m in per_layer], time.perf_counter() - started,
    )  # fmt: skip
    for loss in ("per_layer", "pooled"):
        started = time.perf_counter()
        clt, m = _train(tmp / f"k{k}-clt-{loss}", common, architecture="clt", clt_loss=loss,
                        **_datasets(paths))  # fmt: skip
        out[f"CLT, {loss.replace('_', '-')} loss"] = (
            lambda model, c=clt: clt_replacement(model, c),
            [m[f"val_fvu_layer{t}"] for t in range(layers)], time.perf_counter() - started,
        )  # fmt: skip
    return out


def run() -> str:
    import torch

    from pyspark_safetensors.circuits.evaluate import replacement_evaluation
    from pyspark_safetensors.extract.model import load_model
    from pyspark_safetensors.extract.toy_lm import toy_lm, toy_lm_texts

    from .bench_clt import model_pairs

    torch.set_num_threads(2)
    ks = [int(k) for k in os.environ.get("CLT_REPLACEMENT_K", "8,16").split(",") if k.strip()]
    toy = _toy()
    train, held_out = toy_lm_texts(toy)
    model_dir = str(toy_lm(Path(tempfile.gettempdir()) / "bench-clt-models", toy))
    tokenizer, model = load_model(model_dir)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-clt-replacement-") as tmp:
        paths = model_pairs(Path(tmp), "toy-llama", 1 << 30, model_dir=model_dir,
                            texts=(train, held_out), max_length=toy.context)  # fmt: skip
        layers = len(paths["train_x"])
        shares = _variance_shares(paths)
        tokens = _rows(paths["train_x"][0])
        for k in ks:
            made = _dictionaries(paths, Path(tmp), k, tokens * EPOCHS, layers)
            report = replacement_evaluation(
                model, tokenizer, held_out, {n: f(model) for n, (f, _, _) in made.items()},
                max_length=toy.context,
            )  # fmt: skip
            for name, (_, fvus, seconds) in made.items():
                m = report["models"][name]
                rows.append([k, name, " / ".join(f"{v:.3f}" for v in fvus),
                             f"{m['ce_loss_recovered']:.4f}", f"{m['kl']:.4f}",
                             f"{m['top1']:.3f}", f"{seconds:.0f}"])  # fmt: skip
                print(rows[-1], flush=True)
    header = ["k", "dictionary", "held-out FVU per layer", "CE loss recovered", "KL", "top-1",
              "seconds"]  # fmt: skip
    return (
        f"## The whole network replaced: CLT losses against per-layer transcoders\n\n"
        f"The toy Llama of `conf/pipeline-clt.toml` holding out {toy.held_out_texts} passages "
        f"({report['tokens']:,} held-out next tokens; clean CE {report['ce_clean']:.4f}, every "
        f"MLP zero-ablated {report['ce_zero_ablated']:.4f}). {tokens:,} training tokens, "
        f"{EPOCHS} epochs, {N_LATENTS} latents and k per layer, batch {BATCH}, one process. "
        f"Each layer's share of the MLP outputs' variance: "
        f"{' / '.join(f'{s:.3f}' for s in shares)}. The top k per layer per token encodes.\n\n"
        + table(header, rows)
    )


def _rows(path: str) -> int:
    from pyspark_safetensors.torch import open_dataset

    return len(open_dataset(path))


def _variance_shares(paths) -> list[float]:
    """Each layer's share of the summed variance of the layers' held-out MLP outputs."""
    import numpy as np

    from pyspark_safetensors.torch import open_dataset

    var = []
    for path in paths["val_y"]:
        ds = open_dataset(path)
        y = np.concatenate([ds.shard_view(i, "activation") for i in range(len(ds.paths))])
        y = y.astype(np.float64)
        var.append(float(((y - y.mean(0)) ** 2).sum(1).mean()))
    return [v / sum(var) for v in var]
