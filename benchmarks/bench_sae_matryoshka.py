"""Matryoshka BatchTopK SAEs: ours (``architecture = "matryoshka"``) against SAELens'
``MatryoshkaBatchTopKTrainingSAE`` driven by its ``SAETrainer``, on synthetic activations
with a known hierarchy, same prefixes, k, batches and tokens, each with its own default
initialisation, optimiser and learning rate; ours as a plain BatchTopK SAE of the same
width for reference (its "prefixes" are just its first latents, which nothing orders).

    ./dev bench sae_matryoshka               # needs sae_lens (see ``needs_saelens``)
    SAE_MATRYOSHKA_TRAINERS=ours,saelens SAE_MATRYOSHKA_STEPS=64 ./dev bench sae_matryoshka

``SAE_MATRYOSHKA_TRAINERS`` picks trainers (keys of ``TRAINERS``, comma separated; each
measured row is kept in ``results.json`` beside the data, so rows run one at a time add
up to one table), ``SAE_MATRYOSHKA_STEPS`` the steps of ``BATCH`` tokens.

The activations (``hierarchical_activations``): ``PARENTS`` parent atoms, each with
``CHILDREN`` children of its own, all random unit vectors of width ``D``. Each token
draws ``ACTIVE_PARENTS`` distinct parents, the i-th with weight ``(i + 1)^-ZIPF`` (a
few frequent parents, a long tail); each child of a drawn parent fires with probability
``CHILD_P``, and a child never fires without its parent (the structure Matryoshka SAEs
are for: a flat SAE may fold a parent into its children's latents). Every firing atom
has a log-normal magnitude (sigma 1); the token is their sum plus Gaussian noise of
``NOISE`` per coordinate and a fixed offset. The held-out split is ``VAL_TOKENS`` other
tokens of the same process.

Every SAE is read back by ``load_sae_model`` (SAELens' saves its BatchTopK as a JumpReLU
SAE whose thresholds are its learned one) and scored on the held-out tokens by one
evaluator: ``sae.evaluate.evaluate_sae`` for the whole dictionary's FVU, L0 and dead
latents, and ``prefix_fvus`` for each prefix (the code's latents below ``m`` decoded
alone, the way both trainers define a prefix). Train tokens/s is the wall time of the
whole training call (initialisation included).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import tempfile
import time
from collections.abc import Iterable
from functools import partial
from pathlib import Path

import numpy as np
import torch

from .bench_sae_widths import batches
from .common import table

D, N_LATENTS, PREFIXES, K, BATCH, STEPS = 256, 4096, (256, 1024, 4096), 32, 4096, 128
PARENTS, CHILDREN, ACTIVE_PARENTS, CHILD_P, ZIPF, NOISE = 256, 8, 4, 0.2, 0.7, 0.05
VAL_TOKENS = 16_384
ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "out" / "bench_sae_matryoshka"
BASELINES = ROOT / ".venv-baselines"


def hierarchical_codes(rng: np.random.Generator, rows: int) -> np.ndarray:
    """``[rows, PARENTS * (1 + CHILDREN)]`` float32 magnitudes: columns ``[0, PARENTS)``
    the parents, then parent ``p``'s children at ``PARENTS + p * CHILDREN + c``; drawn as
    the module says."""
    weight = np.log((np.arange(PARENTS) + 1.0) ** -ZIPF)
    # ACTIVE_PARENTS distinct parents by weight: the top of log-weight + Gumbel noise
    keys = weight + rng.gumbel(size=(rows, PARENTS))
    parents = np.argpartition(-keys, ACTIVE_PARENTS - 1, axis=1)[:, :ACTIVE_PARENTS]
    on = np.zeros((rows, PARENTS), bool)
    np.put_along_axis(on, parents, True, axis=1)
    children = on[:, :, None] & (rng.random((rows, PARENTS, CHILDREN)) < CHILD_P)
    fired = np.concatenate([on, children.reshape(rows, -1)], axis=1)
    codes = np.zeros(fired.shape, np.float32)
    codes[fired] = rng.lognormal(0.0, 1.0, int(fired.sum()))
    return codes


def hierarchical_activations(root: Path, *, tokens: int, seed: int = 0) -> dict[str, Path]:
    """``train`` (``tokens`` rows) and ``val`` (``VAL_TOKENS`` rows) float16 token
    datasets of width ``D`` under ``root`` (reused when already there)."""
    from pyspark_safetensors.dataset import write_batch_dataset
    from pyspark_safetensors.format import to_f16

    paths = {split: root / split for split in ("train", "val")}
    if all((p / "dataset_manifest.json").is_file() for p in paths.values()):
        return paths
    rng = np.random.default_rng(seed)
    atoms = rng.standard_normal((PARENTS * (1 + CHILDREN), D)).astype(np.float32)
    atoms /= np.linalg.norm(atoms, axis=1, keepdims=True)
    offset = rng.standard_normal(D).astype(np.float32)
    for split, n in (("val", VAL_TOKENS), ("train", tokens)):  # val first: the same at any size
        out = np.empty((n, D), np.float16)
        for start in range(0, n, 4096):
            rows = min(4096, n - start)
            x = hierarchical_codes(rng, rows) @ atoms + offset
            x += NOISE * rng.standard_normal((rows, D)).astype(np.float32)
            out[start : start + rows] = to_f16(x)
        write_batch_dataset(paths[split], {"activation": out}, rows_per_shard=65536,
                            metadata={"hook_point": f"synthetic.hierarchy.d{D}"})  # fmt: skip
    return paths


def train_ours(train: Path, steps: int, out: Path, *, architecture: str, seed: int = 0) -> Path:
    """Our ``Trainer`` with its shipped defaults."""
    from pyspark_safetensors.sae import SAEConfig
    from pyspark_safetensors.sae.train import Trainer

    prefixes = PREFIXES if architecture == "matryoshka" else ()
    config = SAEConfig(dataset=str(train), n_latents=N_LATENTS, k=K, batch_size=BATCH,
                       tokens=steps * BATCH, seed=seed, out_dir=str(out), checkpoints=0,
                       progress=False, plots=False, log_every=10_000,
                       architecture=architecture, matryoshka_prefixes=prefixes)  # fmt: skip
    Trainer(config).fit()
    return out / "sae.safetensors"


def train_saelens(train: Path, steps: int, out: Path, *, seed: int = 0,
                  ours_schedule: bool = False) -> Path:  # fmt: skip
    """SAELens' ``MatryoshkaBatchTopKTrainingSAE`` with its config's defaults and its
    runner's optimiser defaults (Adam 0.9/0.999, lr 3e-4 constant), saved as its inference
    SAE (a JumpReLU SAE at the learned threshold, decoder norms folded). ``ours_schedule``:
    our default learning rate, Adam betas, warm-up and decay instead (its scheduler's
    linear warm-up and linear decay to 0)."""
    from sae_lens import MatryoshkaBatchTopKTrainingSAE, MatryoshkaBatchTopKTrainingSAEConfig
    from sae_lens.config import SAETrainerConfig
    from sae_lens.training.sae_trainer import SAETrainer

    from pyspark_safetensors.sae import SAEConfig

    torch.manual_seed(seed)
    sae = MatryoshkaBatchTopKTrainingSAE(MatryoshkaBatchTopKTrainingSAEConfig(
        d_in=D, d_sae=N_LATENTS, k=K, matryoshka_widths=list(PREFIXES)))  # fmt: skip
    schedule: dict = {"lr": 3e-4, "lr_end": 3e-5}  # the runner config's defaults
    if ours_schedule:
        c = SAEConfig(d=D, n_latents=N_LATENTS, k=K)
        schedule = {"lr": c.learning_rate, "lr_end": c.learning_rate / 10,
                    "adam_beta1": c.adam_betas[0], "adam_beta2": c.adam_betas[1],
                    "lr_warm_up_steps": round(c.warmup_fraction * steps),
                    "lr_decay_steps": round(c.decay_fraction * steps)}  # fmt: skip
    cfg = SAETrainerConfig(total_training_samples=steps * BATCH, train_batch_size_samples=BATCH,
                           **schedule)  # fmt: skip
    SAETrainer(cfg, sae, batches(train, seed, steps, BATCH)).fit()
    sae.save_inference_model(out)
    return out


#: name: (the table's label, the training call)
TRAINERS = {
    "ours": ("ours, matryoshka", partial(train_ours, architecture="matryoshka")),
    "saelens": ("SAELens, matryoshka_batchtopk", train_saelens),
    "saelens-our-lr": ("SAELens, matryoshka_batchtopk at our lr, betas, warm-up and decay",
                       partial(train_saelens, ours_schedule=True)),
    "ours-batchtopk": ("ours, batchtopk (no prefixes)",
                       partial(train_ours, architecture="batchtopk")),
}  # fmt: skip


@torch.no_grad()
def prefix_fvus(sae, data: Iterable[torch.Tensor], prefixes=PREFIXES) -> list[float]:
    """Each prefix's FVU on ``data``: the code (eval mode, as in use) restricted to the
    latents below ``m`` and decoded with the decoder bias, one float per prefix."""
    sae.eval()
    sums = torch.zeros(len(prefixes), 3, dtype=torch.float64)  # squared error, sum y^2, n
    mean = None
    for x in data:
        x = x.float()
        out = sae(x)
        mean = x.double().sum(0) if mean is None else mean + x.double().sum(0)
        for i, m in enumerate(prefixes):
            x_hat = sae.decode(out.values * (out.indices < m), out.indices)
            sums[i, 0] += (x_hat.double() - x.double()).pow(2).sum()
            sums[i, 1] += x.double().pow(2).sum()
            sums[i, 2] += x.shape[0]
    if mean is None:
        raise ValueError("no held-out rows")
    var = sums[:, 1] - mean.pow(2).sum() / sums[:, 2]
    return (sums[:, 0] / var).tolist()


def measure(name: str, paths: dict[str, Path], steps: int) -> dict:
    from pyspark_safetensors.sae import load_sae_model
    from pyspark_safetensors.sae.evaluate import evaluate_sae, held_out_batches

    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        path = TRAINERS[name][1](paths["train"], steps, Path(tmp) / "sae")
        seconds = time.perf_counter() - started
        sae = load_sae_model(path, k=K)
        m = evaluate_sae(sae, held_out_batches(paths["val"]))
        prefixes = prefix_fvus(sae, held_out_batches(paths["val"]))
    return {"fvu": m["fvu"], "prefixes": prefixes, "l0": m["l0"], "dead": m["dead_fraction"],
            "tokens_per_s": steps * BATCH / seconds}  # fmt: skip


def needs_saelens() -> str:
    """How to install SAELens beside ``.venv`` without touching it."""
    site = ".venv-baselines/lib/python3.11/site-packages"
    return (
        "sae_lens is not importable here. Install it in a venv of its own that sees .venv:\n"
        "  python -m venv .venv-baselines\n"
        f"  echo \"import site; site.addsitedir('{ROOT}/.venv/lib/python3.11/site-packages')\" "
        f"> {site}/main-venv.pth\n"
        "  .venv-baselines/bin/pip install sae-lens\n"
        "then run ./dev bench sae_matryoshka again (it uses .venv-baselines/bin/python)."
    )


def body(steps: int, names: list[str]) -> str:
    """Train and score the trainers ``names`` (keys of ``TRAINERS``), keeping each row in
    ``results.json`` beside the data; the section's markdown, with every kept row."""
    import json

    tokens = steps * BATCH
    root = CACHE / f"d{D}-{tokens}"
    paths = hierarchical_activations(root, tokens=tokens)
    kept = root / "results.json"
    results = json.loads(kept.read_text()) if kept.is_file() else {}
    for name in names:
        results[name] = m = measure(name, paths, steps)
        print(name, m, flush=True)
        kept.write_text(json.dumps(results, indent=1))
    env = "" if steps == STEPS else f"SAE_MATRYOSHKA_STEPS={steps} "
    rows = []
    for name in (n for n in TRAINERS if n in results):
        m = results[name]
        command = f"`{env}SAE_MATRYOSHKA_TRAINERS={name} ./dev bench sae_matryoshka`"
        rows.append([TRAINERS[name][0], f"{m['fvu']:.4f}", *(f"{f:.4f}" for f in m["prefixes"]),
                     f"{m['l0']:.1f}", f"{m['dead']:.1%}", f"{m['tokens_per_s']:,.0f}",
                     command])  # fmt: skip
    header = ["trainer", "held-out FVU", *(f"FVU, first {m:,}" for m in PREFIXES), "L0",
              "dead", "train tokens/s", "command"]  # fmt: skip
    atoms = PARENTS * (1 + CHILDREN)
    return (
        f"## Matryoshka BatchTopK: ours against SAELens\n\n"
        f"Synthetic activations with a hierarchy (`bench_sae_matryoshka."
        f"hierarchical_activations`): d = {D}, {PARENTS} parent atoms with {CHILDREN} "
        f"children each ({atoms:,} random unit atoms); a token draws {ACTIVE_PARENTS} "
        f"distinct parents (weights (i + 1)^-{ZIPF}), each child of a drawn parent fires with "
        f"probability {CHILD_P} and never without it, log-normal magnitudes (sigma 1), "
        f"Gaussian noise {NOISE} and a fixed offset, stored as float16. {N_LATENTS:,} latents, "
        f"prefixes {' / '.join(f'{m:,}' for m in PREFIXES)}, k = {K}, batch {BATCH:,}, "
        f"{steps} steps = {tokens:,} training tokens (one pass), the same batches for every "
        f"trainer, each with its own initialisation, optimiser and learning rate (ours: Adam "
        f"at our default lr with warm-up and decay; SAELens: Adam 3e-4 constant, its "
        f"defaults; and SAELens again with our lr, betas and schedule). Held-out FVU, L0 "
        f"and dead latents on {VAL_TOKENS:,} other tokens "
        f"(`evaluate_sae`), each prefix's FVU by `prefix_fvus` (the code's latents below m "
        f"alone). The plain BatchTopK row's prefixes are unordered latents: what nesting "
        f"buys. SAELens' inference threshold is a running average (rate 0.01, from 0) of the "
        f"smallest kept activation, so after a short run it lies below its target and the "
        f"held-out L0 exceeds k; its AuxK starts on latents dead for 1,000 steps "
        f"(`dead_feature_window`), longer than these runs. Train tokens/s: the whole "
        f"training call (2 cores, no other job running). Rows are kept across runs "
        f"(`results.json` beside the data).\n\n" + table(header, rows)
    )


def run() -> str:
    steps = int(os.environ.get("SAE_MATRYOSHKA_STEPS", STEPS))
    raw = os.environ.get("SAE_MATRYOSHKA_TRAINERS", "")
    names = [n.strip() for n in raw.split(",") if n.strip()] or list(TRAINERS)
    unknown = sorted(set(names) - set(TRAINERS))
    if unknown:
        raise SystemExit(f"SAE_MATRYOSHKA_TRAINERS: unknown {unknown}; known: {list(TRAINERS)}")
    if importlib.util.find_spec("sae_lens") is not None:
        return body(steps, names)
    python = BASELINES / "bin" / "python"
    if not python.is_file():
        raise SystemExit(needs_saelens())
    # SAELens lives in its own venv (which sees ours): the section is measured there
    with tempfile.TemporaryDirectory() as tmp:
        section = Path(tmp) / "section.md"
        code = ("from pathlib import Path; from benchmarks.bench_sae_matryoshka import body; "
                f"Path({str(section)!r}).write_text(body({steps}, {names!r}))")  # fmt: skip
        if subprocess.run([str(python), "-c", code], cwd=ROOT, check=False).returncode:
            raise SystemExit(f"{python}: the benchmark failed (its error is above)")
        return section.read_text()
