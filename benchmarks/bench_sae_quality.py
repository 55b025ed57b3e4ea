"""SAE quality at equal L0, dictionary size and token budget: our trainer with its shipped
defaults against EleutherAI sparsify and SAELens with theirs (when installed: the
``baselines`` extra), on MiniLM's layer-0 query input for the demo corpus, split by text
90/10, at 8x and 32x its width (3,072 and 12,288 latents). Every SAE is scored by one
evaluator (``sae.evaluate.evaluate_sae``) on the held-out texts, and turned into a LUT for
the query layer whose relative error is measured on the same texts.

    python -m benchmarks sae_quality            # SAE_QUALITY_DATA=dataset dir to reuse one

A second table compares transcoders (plain and skip) with sparsify's ``transcode=True``
(and ``skip_connection=True``) on synthetic MLP-like pairs (``synthetic_pairs``), both
read through the same pair loader and scored by the same evaluator (FVU of the target),
at MiniLM's width (``PAIRS``) and at a research width (``RESEARCH_PAIRS``: d = 768,
16,384 latents, 524,288 tokens), and a third a crosscoder over those two hook points
against one SAE per hook point at the same total latents::

    python -c "from benchmarks.bench_sae_quality import run_transcoders; print(run_transcoders())"
    python -c "from benchmarks.bench_sae_quality import run_crosscoders; print(run_crosscoders())"

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

from .bench_sae_widths import batches
from .bench_sae_widths import train_sparsify as sparsify_trainer
from .common import table

K, BATCH, EPOCHS, SEEDS = 32, 4096, 4, (0, 1)
#: MiniLM's 384 dimensions at 8x and 32x: every trainer at the first, the shipped
#: defaults of each (no ablation rows) at the second.
WIDTHS = (3072, 12288)
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


def train_ours(train: Path, n: int, seed: int, steps: int, out: Path, **overrides) -> Path:
    from pyspark_safetensors.sae import SAEConfig
    from pyspark_safetensors.sae.train import Trainer

    config = SAEConfig(dataset=str(train), n_latents=n, k=K, batch_size=BATCH,
                       tokens=steps * BATCH, seed=seed, out_dir=str(out), checkpoints=0,
                       progress=False, log_every=1000, **overrides)  # fmt: skip
    Trainer(config).fit()
    return out / "sae.safetensors"


def train_ours_adam_defaults(train: Path, n: int, seed: int, steps: int, out: Path) -> Path:
    """Ours with Adam's textbook betas (0.9, 0.999), the defaults before (0.8, 0.98)."""
    return train_ours(train, n, seed, steps, out, adam_betas=(0.9, 0.999))


def train_sparsify(train: Path, n: int, seed: int, steps: int, out: Path) -> Path:
    return sparsify_trainer(train, n, steps * BATCH, out, seed=seed, batch=BATCH, k=K)


def train_saelens(train: Path, n: int, seed: int, steps: int, out: Path) -> Path:
    from sae_lens import TopKTrainingSAE, TopKTrainingSAEConfig
    from sae_lens.config import SAETrainerConfig
    from sae_lens.training.sae_trainer import SAETrainer

    torch.manual_seed(seed)
    sae = TopKTrainingSAE(TopKTrainingSAEConfig(d_in=384, d_sae=n, k=K))
    # the runner config's defaults: lr 3e-4 constant, lr_end = lr / 10 (unused when constant)
    cfg = SAETrainerConfig(total_training_samples=steps * BATCH, train_batch_size_samples=BATCH,
                           lr=3e-4, lr_end=3e-5)  # fmt: skip
    SAETrainer(cfg, sae, batches(train, seed, steps, BATCH)).fit()
    sae.save_inference_model(out)
    return out


HEADER = ["trainer", "latents", "seed", "held-out FVU", "L0", "dead", "dense (>10 %)",
          "train tokens/s", "LUT rel. L2"]  # fmt: skip
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


# --- transcoders on synthetic pairs -----------------------------------------------------

#: The transcoder comparison's default size: MiniLM's width at 8x, the SAE table's k and
#: batch, 64 steps; and a research width, the SAE width sweep's smallest dictionary
#: (``bench_sae_widths``) over its longer budget.
PAIRS = dict(d=384, n_latents=3072, k=32, batch=4096, tokens=262_144, val_tokens=16_384)
RESEARCH_PAIRS = dict(PAIRS, d=768, n_latents=16_384, tokens=524_288)


def synthetic_pairs(root: Path, *, d: int, tokens: int, seed: int = 0) -> dict[str, Path]:
    """An MLP's input and output hook points with known structure, written as two
    row-aligned datasets per split (``train_in``, ``train_out``, ``val_in``, ``val_out``):
    a dictionary of ``4 d`` unit atoms for the input and another for the output (the
    MLP's output per feature); each token draws 8 atoms uniformly with heavy-tailed
    magnitudes (log-normal, sigma 1), so ``x = code @ atoms_in + 0.05 noise + a mean
    offset`` and ``y = code @ atoms_out + x @ A^T + 0.05 noise``, with ``A`` a dense
    linear map of norm ~0.5 per output coordinate (what a skip path can take and a sparse
    code can only approximate)."""
    from pyspark_safetensors.dataset import write_batch_dataset

    rng = np.random.default_rng(seed)
    atoms = 4 * d

    def unit(rows):
        m = rng.standard_normal((rows, d)).astype(np.float32)
        return m / np.linalg.norm(m, axis=1, keepdims=True)

    atoms_in, atoms_out = unit(atoms), unit(atoms)
    offset = rng.standard_normal(d).astype(np.float32)
    linear = (0.5 * rng.standard_normal((d, d)) / np.sqrt(d)).astype(np.float32)
    paths = {}
    for split, n in (("train", tokens), ("val", PAIRS["val_tokens"])):
        xs, ys = [], []
        for start in range(0, n, 16384):
            rows = min(16384, n - start)
            idx = np.argsort(rng.random((rows, atoms)), axis=1)[:, :8]
            mags = rng.lognormal(0.0, 1.0, (rows, 8)).astype(np.float32)
            code = np.zeros((rows, atoms), np.float32)
            np.put_along_axis(code, idx, mags, axis=1)
            x = code @ atoms_in + 0.05 * rng.standard_normal((rows, d)).astype(np.float32) + offset
            y = (
                code @ atoms_out
                + x @ linear.T
                + 0.05 * rng.standard_normal((rows, d)).astype(np.float32)
            )
            xs.append(x)
            ys.append(y)
        ids = {"sample_id": np.arange(n, dtype=np.int64) // 128,
               "token_pos": np.arange(n, dtype=np.int32) % 128}  # fmt: skip
        for name, arrays in (("in", xs), ("out", ys)):
            paths[f"{split}_{name}"] = root / f"{split}_{name}"
            write_batch_dataset(paths[f"{split}_{name}"],
                                {"activation": np.concatenate(arrays), **ids},
                                rows_per_shard=16384, metadata={"hook_point": f"mlp:{name}"})  # fmt: skip
    return paths


def _pair_config(paths, arch, size, seed, out):
    from pyspark_safetensors.sae import SAEConfig

    return SAEConfig(architecture=arch, dataset=str(paths["train_in"]),
                     target_dataset=str(paths["train_out"]), n_latents=size["n_latents"],
                     k=size["k"], batch_size=size["batch"], tokens=size["tokens"], seed=seed,
                     out_dir=str(out), checkpoints=0, progress=False, plots=False,
                     log_every=1000)  # fmt: skip


def train_ours_pairs(paths, arch, size, seed, out) -> Path:
    from pyspark_safetensors.sae.train import Trainer

    Trainer(_pair_config(paths, arch, size, seed, out)).fit()
    return out / "sae.safetensors"


def train_sparsify_pairs(paths, arch, size, seed, out) -> Path:
    """sparsify's ``Trainer`` step for a transcoder on the same batches: Signum in
    ScheduleFree at its default lr, ``encoder.bias = -mean(x) W^T`` and ``b_dec =
    mean(y)`` from the first batch, no decoder normalisation (sparsify skips it for
    transcoders), no AuxK (its default ``auxk_alpha = 0``)."""
    from schedulefree import ScheduleFreeWrapper
    from sparsify import SparseCoder, SparseCoderConfig
    from sparsify.sign_sgd import SignSGD

    from pyspark_safetensors.sae.sources import open_source
    from pyspark_safetensors.torch import ActivationLoader

    torch.manual_seed(seed)
    n = size["n_latents"]
    cfg = SparseCoderConfig(num_latents=n, k=size["k"], transcode=True,
                            skip_connection=arch == "skip_transcoder")  # fmt: skip
    sae = SparseCoder(size["d"], cfg, device="cpu")
    lr = 5e-3 / (n / 2**14) ** 0.5
    opt = ScheduleFreeWrapper(SignSGD([{"params": sae.parameters(), "lr": lr}]), momentum=0.95)
    opt.train()
    source = open_source(_pair_config(paths, arch, size, seed, out))
    loader = ActivationLoader(source.dataset, size["batch"], columns=source.columns, seed=seed,
                              drop_last=True, dp_rank=0, dp_size=1)  # fmt: skip
    for step, batch in zip(range(size["tokens"] // size["batch"]), loader, strict=False):
        x, y = source.pair(batch)
        if step == 0:
            sae.encoder.bias.data = -x.mean(0) @ sae.encoder.weight.data.T
            sae.b_dec.data = y.mean(0)
        sae(x, y).fvu.backward()
        opt.step()
        opt.zero_grad()
    opt.eval()  # ScheduleFree: the averaged weights are the model
    sae.save_to_disk(out)
    return out


PAIR_HEADER = ["trainer", "architecture", "held-out FVU (of y)", "L0", "dead", "train tokens/s"]


def run_transcoders(size: dict | None = None, seeds=(0,)) -> str:
    """The transcoder table (ours against sparsify when installed) at ``size``
    (``PAIRS`` by default)."""
    import importlib.util

    from pyspark_safetensors.sae import load_sae_model
    from pyspark_safetensors.sae.evaluate import evaluate_sae
    from pyspark_safetensors.sae.sources import open_source

    size = {**PAIRS, **(size or {})}
    trainers = {"ours": train_ours_pairs}
    if importlib.util.find_spec("sparsify") is not None:
        trainers["sparsify"] = train_sparsify_pairs
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = synthetic_pairs(Path(tmp) / "pairs", d=size["d"], tokens=size["tokens"])
        for arch in ("transcoder", "skip_transcoder"):
            for name, fn in trainers.items():
                for seed in seeds:
                    out = Path(tmp) / f"{name}-{arch}-{seed}"
                    started = time.perf_counter()
                    path = fn(paths, arch, size, seed, out)
                    seconds = time.perf_counter() - started
                    sae = load_sae_model(path)
                    config = _pair_config(paths, arch, size, seed, out)
                    val = open_source(replace_val(config, paths), held_out=True)
                    m = evaluate_sae(sae, val.batches(batch=size["batch"]))
                    rows.append([f"{name} (seed {seed})", arch, f"{m['fvu']:.4f}",
                                 f"{m['l0']:.1f}", f"{m['dead_fraction']:.1%}",
                                 f"{size['tokens'] / seconds:,.0f}"])  # fmt: skip
                    print(rows[-1], flush=True)
    missing = "" if "sparsify" in trainers else " sparsify is not installed: not measured."
    return (
        f"Transcoders on synthetic MLP-like pairs (`synthetic_pairs`: d = {size['d']}, "
        f"{4 * size['d']} atoms, 8 active per token with log-normal magnitudes, a dense "
        f"linear part in y): {size['n_latents']} latents, k = {size['k']}, batch "
        f"{size['batch']}, {size['tokens']:,} training tokens, held-out FVU of the target on "
        f"{size['val_tokens']:,} other tokens, every transcoder read by `load_sae_model` and "
        f"scored by `evaluate_sae`.{missing}\n\n" + table(PAIR_HEADER, rows)
    )


CROSS_HEADER = ["model", "latents", "k", "held-out FVU (in)", "held-out FVU (out)",
                "L0 per token", "dead"]  # fmt: skip


def run_crosscoders(size: dict | None = None, seed: int = 0) -> str:
    """A crosscoder over two hook points (``synthetic_pairs``' input and output, one sparse
    code behind both) against one TopK SAE per hook point with the same total latents:
    each hook point's held-out FVU, the active latents per token (the crosscoder at k
    and at 2k, the SAEs' k each) and the dead latents."""
    from pyspark_safetensors.sae import SAEConfig
    from pyspark_safetensors.sae.evaluate import evaluate_sae
    from pyspark_safetensors.sae.sources import open_source
    from pyspark_safetensors.sae.train import Trainer

    size = {**PAIRS, **(size or {})}
    n, k = size["n_latents"], size["k"]
    common = dict(batch_size=size["batch"], tokens=size["tokens"], seed=seed, checkpoints=0,
                  progress=False, plots=False, log_every=1000)  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = synthetic_pairs(Path(tmp) / "pairs", d=size["d"], tokens=size["tokens"])
        hooks = [str(paths["train_in"]), str(paths["train_out"])]
        vals = [str(paths["val_in"]), str(paths["val_out"])]
        for kk in (k, 2 * k):
            config = SAEConfig(architecture="crosscoder", datasets=tuple(hooks),
                               val_datasets=tuple(vals), n_latents=2 * n, k=kk,
                               out_dir=f"{tmp}/cc{kk}", **common)  # fmt: skip
            trainer = Trainer(config)
            trainer.fit()
            m = evaluate_sae(trainer.sae, open_source(config, held_out=True).batches())
            rows.append(["crosscoder", 2 * n, kk, f"{m['fvu_mlp:in']:.4f}",
                         f"{m['fvu_mlp:out']:.4f}", f"{m['l0']:.1f}",
                         f"{m['dead_fraction']:.1%}"])  # fmt: skip
            print(rows[-1], flush=True)
        fvus, l0, dead = [], 0.0, 0.0
        for i, (train, val) in enumerate(zip(hooks, vals, strict=True)):
            config = SAEConfig(dataset=train, val_dataset=val, n_latents=n, k=k,
                               out_dir=f"{tmp}/sae{i}", **common)  # fmt: skip
            trainer = Trainer(config)
            trainer.fit()
            m = evaluate_sae(trainer.sae, open_source(config, held_out=True).batches())
            fvus.append(f"{m['fvu']:.4f}")
            l0, dead = l0 + m["l0"], dead + m["dead_fraction"] / 2
        rows.append(["one TopK SAE per hook point", f"2 x {n}", k, *fvus, f"{l0:.1f}",
                     f"{dead:.1%}"])  # fmt: skip
        print(rows[-1], flush=True)
    return (
        f"A crosscoder over two hook points (`synthetic_pairs`' input and output, d = "
        f"{size['d']} each) against one SAE per hook point with the same total latents, "
        f"batch {size['batch']}, {size['tokens']:,} training tokens, held-out FVU of each "
        f"hook point on {size['val_tokens']:,} other tokens (`evaluate_sae`).\n\n"
        + table(CROSS_HEADER, rows)
    )


def replace_val(config, paths):
    import dataclasses

    return dataclasses.replace(config, val_dataset=str(paths["val_in"]),
                               val_target_dataset=str(paths["val_out"]))  # fmt: skip


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
    missing = [name for name in NEEDS if importlib.util.find_spec(NEEDS[name]) is None]
    rows = []
    for n in WIDTHS:
        for name, fn in TRAINERS.items():
            if name in missing or (n != WIDTHS[0] and fn is train_ours_adam_defaults):
                continue  # not installed; or the betas' ablation, measured at 8x only
            for seed in SEEDS:
                with tempfile.TemporaryDirectory() as tmp:
                    started = time.perf_counter()
                    path = fn(train, n, seed, steps, Path(tmp) / "sae")
                    seconds = time.perf_counter() - started
                    sae = load_sae_model(path, k=K)
                    m = evaluate_sae(sae, held_out_batches(val))
                    extra = ""
                    if name.startswith("ours"):
                        extra = f" (unfolded: {lut_error(path, x_val[:8192], fold=False):.3f})"
                    rows.append([
                        name, f"{n:,}", seed, f"{m['fvu']:.4f}", f"{m['l0']:.1f}",
                        f"{m['dead_fraction']:.1%}", f"{m['dense_fraction']:.1%}",
                        f"{steps * BATCH / seconds:,.0f}",
                        f"{lut_error(path, x_val[:8192]):.3f}{extra}",
                    ])  # fmt: skip
                print(rows[-1], flush=True)
    note = f" Not installed, so not measured: {', '.join(missing)}." if missing else ""
    widths = " and ".join(f"{n:,} ({n // 384}x)" for n in WIDTHS)
    return (
        f"Held-out quality at equal budget: {widths} latents, k = {K}, batch {BATCH}, "
        f"{steps} steps = {steps * BATCH:,} training tokens ({EPOCHS} epochs of the 90 % of "
        f"texts), evaluated on the other {len(x_val):,} tokens (10 % of the texts). "
        f"LUT error: query layer, k = {K}, no compensation, first 8,192 held-out tokens; "
        f"for ours also with the encoder bias the LUT stored before the fold.{note}\n\n"
        + table(HEADER, rows)
        + "\n\n"
        + run_transcoders()
        + "\n\n"
        + run_transcoders(RESEARCH_PAIRS)
        + "\n\n"
        + run_crosscoders()
    )
