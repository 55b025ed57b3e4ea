"""SAE quality and speed at research widths: our trainer with its shipped defaults against
EleutherAI sparsify's (Signum in ScheduleFree, its default lr; the step of
``bench_sae_quality.train_sparsify``) on synthetic activations with known structure, at
d = 768 with 16,384 / 24,576 / 32,768 latents, k = 32, batch 4,096, over token budgets.

    python -m benchmarks sae_widths                          # every width and budget
    SAE_WIDTHS=16384 SAE_WIDTHS_TOKENS=262144 python -m benchmarks sae_widths

``SAE_WIDTHS`` (latents) and ``SAE_WIDTHS_TOKENS`` (training tokens) pick a subset, comma
separated; ``SAE_WIDTHS_TRAINERS`` (``ours,sparsify``) the trainers; ``SAE_WIDTHS_DATA``
a directory to keep the generated data in (default ``out/bench_sae_widths``);
``SAE_WIDTHS_NOTE`` a sentence for the table's text (why a budget was left out). Each
measured row is kept there (``results.json``, by trainer, width and budget) and the table
shows every kept row, so subsets run one after another (a CPU machine's widths one at a
time) add up to one table; ``SAE_WIDTHS_FRESH=1`` forgets the kept rows first, and
``SAE_WIDTHS_TRAINERS=`` (none) measures nothing and writes the kept rows' table.

The activations (``synthetic_activations``): a dictionary of ``16 d`` random unit-norm
atoms; each token draws 16 atoms (with replacement) from a power law, the i-th atom with
probability proportional to ``(i + 1)^-0.7`` (a few frequent features, a long tail of rare
ones), each with a log-normal magnitude (sigma 1, a heavy tail); the token is their sum,
plus Gaussian noise of 0.05 per coordinate (about 1.6 % of the variance: the FVU's floor)
and a fixed offset (what the decoder bias learns). Written as float16 token datasets;
the held-out split is 16,384 other tokens from the same process.

Both trainers read the same batches: ours builds its ``ActivationLoader`` from the config,
sparsify's step reads one built with the same arguments (``batches``); every SAE is read
back and scored by one evaluator (``sae.evaluate.evaluate_sae``) on the held-out tokens.
Train tokens/s is the wall time of the whole training call (initialisation included).
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from .common import table

D, K, BATCH = 768, 32, 4096
WIDTHS = (16_384, 24_576, 32_768)
BUDGETS = (262_144, 524_288, 1_048_576, 2_097_152)
VAL_TOKENS = 16_384
ACTIVE, ZIPF, NOISE = 16, 0.7, 0.05
CACHE = Path(__file__).resolve().parent.parent / "out" / "bench_sae_widths"


def _ints(name: str, default: tuple[int, ...]) -> tuple[int, ...]:
    raw = os.environ.get(name, "").strip()
    return tuple(int(v) for v in raw.split(",") if v.strip()) if raw else default


def synthetic_activations(root: Path, *, d: int, tokens: int, seed: int = 0) -> dict[str, Path]:
    """``train`` (``tokens`` rows) and ``val`` (``VAL_TOKENS`` rows) token datasets of
    width ``d`` under ``root`` (reused when already there), made as the module says."""
    from pyspark_safetensors.dataset import write_batch_dataset
    from pyspark_safetensors.format import to_f16

    paths = {split: root / split for split in ("train", "val")}
    if all((p / "dataset_manifest.json").is_file() for p in paths.values()):
        return paths
    rng = np.random.default_rng(seed)
    n_atoms = 16 * d
    atoms = rng.standard_normal((n_atoms, d)).astype(np.float32)
    atoms /= np.linalg.norm(atoms, axis=1, keepdims=True)
    freq = (np.arange(n_atoms) + 1.0) ** -ZIPF
    freq /= freq.sum()
    offset = rng.standard_normal(d).astype(np.float32)
    for split, n in (("val", VAL_TOKENS), ("train", tokens)):  # val first: the same at any size
        out = np.empty((n, d), np.float16)
        for start in range(0, n, 16384):
            rows = min(16384, n - start)
            idx = rng.choice(n_atoms, size=(rows, ACTIVE), p=freq)
            mags = rng.lognormal(0.0, 1.0, (rows, ACTIVE)).astype(np.float32)
            x = np.einsum("ra,rad->rd", mags, atoms[idx])
            x += NOISE * rng.standard_normal((rows, d)).astype(np.float32) + offset
            out[start : start + rows] = to_f16(x)
        ids = {"sample_id": np.arange(n, dtype=np.int64) // 128}
        write_batch_dataset(paths[split], {"activation": out, **ids}, rows_per_shard=65536,
                            metadata={"hook_point": f"synthetic.d{d}"})  # fmt: skip
    return paths


def batches(train: Path, seed: int, steps: int, batch: int = BATCH) -> Iterator[torch.Tensor]:
    """``steps`` float32 batches in the order our trainer reads them (its loader's
    arguments for one process), epochs repeated if needed."""
    from pyspark_safetensors.torch import ActivationLoader, open_dataset

    loader = ActivationLoader(open_dataset(train), batch, columns=["activation"], seed=seed,
                              drop_last=True, dp_rank=0, dp_size=1)  # fmt: skip
    done = 0
    while done < steps:
        for b in loader:
            yield b["activation"]
            done += 1
            if done == steps:
                return


def train_ours(train: Path, n_latents: int, tokens: int, out: Path, *, seed: int = 0,
               batch: int = BATCH, k: int = K, **overrides) -> Path:  # fmt: skip
    """Our ``Trainer`` with its shipped defaults (``overrides`` change them)."""
    from pyspark_safetensors.sae import SAEConfig
    from pyspark_safetensors.sae.train import Trainer

    config = SAEConfig(dataset=str(train), n_latents=n_latents, k=k, batch_size=batch,
                       tokens=tokens, seed=seed, out_dir=str(out), checkpoints=0,
                       progress=False, plots=False, log_every=10_000, **overrides)  # fmt: skip
    Trainer(config).fit()
    return out / "sae.safetensors"


def train_sparsify(train: Path, n_latents: int, tokens: int, out: Path, *, seed: int = 0,
                   batch: int = BATCH, k: int = K) -> Path:  # fmt: skip
    """sparsify's ``Trainer`` step with its defaults: Signum in ScheduleFree (momentum
    0.95) at lr 5e-3 / sqrt(n / 2^14), no schedule, ``b_dec`` the first batch's mean,
    unit-norm decoder rows with the gradient along them removed, no AuxK."""
    from schedulefree import ScheduleFreeWrapper
    from sparsify import SparseCoder, SparseCoderConfig
    from sparsify.sign_sgd import SignSGD

    torch.manual_seed(seed)
    d = next(batches(train, seed, 1, batch)).shape[1]
    sae = SparseCoder(d, SparseCoderConfig(num_latents=n_latents, k=k), device="cpu")
    lr = 5e-3 / (n_latents / 2**14) ** 0.5
    opt = ScheduleFreeWrapper(SignSGD([{"params": sae.parameters(), "lr": lr}]), momentum=0.95)
    opt.train()
    for step, x in enumerate(batches(train, seed, tokens // batch, batch)):
        if step == 0:
            sae.b_dec.data = x.mean(0)
        sae.set_decoder_norm_to_unit_norm()
        sae(x).fvu.backward()
        sae.remove_gradient_parallel_to_decoder_directions()
        opt.step()
        opt.zero_grad()
    opt.eval()  # ScheduleFree: the averaged weights are the model
    sae.set_decoder_norm_to_unit_norm()
    sae.save_to_disk(out)
    return out


TRAINERS = {"ours": train_ours, "sparsify": train_sparsify}


def measure(trainer: str, paths: dict[str, Path], n_latents: int, tokens: int, **kw) -> dict:
    """Train with ``trainer`` and score on the held-out split: held-out FVU, L0, dead
    fraction and train tokens/s."""
    from pyspark_safetensors.sae import load_sae_model
    from pyspark_safetensors.sae.evaluate import evaluate_sae, held_out_batches

    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        path = TRAINERS[trainer](paths["train"], n_latents, tokens, Path(tmp) / "sae", **kw)
        seconds = time.perf_counter() - started
        m = evaluate_sae(load_sae_model(path, k=kw.get("k", K)), held_out_batches(paths["val"]))
    return {"fvu": m["fvu"], "l0": m["l0"], "dead": m["dead_fraction"],
            "tokens_per_s": tokens / seconds}  # fmt: skip


HEADER = ["trainer", "latents", "tokens", "held-out FVU", "L0", "dead", "train tokens/s",
          "command"]  # fmt: skip


def run() -> str:
    import json

    widths = _ints("SAE_WIDTHS", WIDTHS)
    budgets = _ints("SAE_WIDTHS_TOKENS", BUDGETS)
    names = [n.strip() for n in os.environ.get("SAE_WIDTHS_TRAINERS", "ours,sparsify").split(",")]
    missing = [n for n in names if n == "sparsify" and importlib.util.find_spec("sparsify") is None]
    names = [n for n in names if n and n not in missing]
    root = Path(os.environ.get("SAE_WIDTHS_DATA", CACHE))
    if names:  # none (SAE_WIDTHS_TRAINERS=""): only the table of the kept rows
        paths = synthetic_activations(root / f"d{D}-{max(budgets)}", d=D, tokens=max(budgets))
    kept = root / "results.json"
    results = {} if os.environ.get("SAE_WIDTHS_FRESH") or not kept.is_file() else (
        json.loads(kept.read_text()))  # fmt: skip
    for n in widths if names else ():
        for tokens in budgets:
            for name in names:
                results[f"{name}/{n}/{tokens}"] = m = measure(name, paths, n, tokens)
                print(name, n, tokens, m, flush=True)
                kept.write_text(json.dumps(results, indent=1))
    rows = []
    for key in sorted(results, key=lambda key: (int(key.split("/")[1]), int(key.split("/")[2]))):
        name, n, tokens = key.split("/")
        m = results[key]
        command = f"`SAE_WIDTHS={n} SAE_WIDTHS_TOKENS={tokens} python -m benchmarks sae_widths`"
        rows.append([name, f"{int(n):,}", f"{int(tokens):,}", f"{m['fvu']:.4f}", f"{m['l0']:.1f}",
                     f"{m['dead']:.1%}", f"{m['tokens_per_s']:,.0f}", command])  # fmt: skip
    note = f" Not installed, so not measured: {', '.join(missing)}." if missing else ""
    absent = [f"{t:,}" for t in BUDGETS if not any(k.endswith(f"/{t}") for k in results)]
    if absent:
        note += f" Budgets not measured: {', '.join(absent)} tokens."
    if os.environ.get("SAE_WIDTHS_NOTE"):  # what a partial run says about itself
        note += " " + os.environ["SAE_WIDTHS_NOTE"].strip()
    return (
        f"## SAE quality at research widths\n\n"
        f"Synthetic activations with known structure (`bench_sae_widths.synthetic_activations`): "
        f"d = {D}, a dictionary of {16 * D:,} random unit-norm atoms, {ACTIVE} drawn per token "
        f"(with replacement) with probability proportional to (i + 1)^-{ZIPF}, log-normal "
        f"magnitudes (sigma 1), Gaussian noise {NOISE} per coordinate (about 1.6 % of the "
        f"variance) and a fixed offset, stored as float16. k = {K}, batch {BATCH:,}, both "
        f"trainers on the same batches, held-out FVU on {VAL_TOKENS:,} other tokens "
        f"(`evaluate_sae`); train tokens/s is the whole training call's (initialisation "
        f"included). Rows are kept across runs of subsets (`results.json`).{note}\n\n"
        + table(HEADER, rows)
    )
