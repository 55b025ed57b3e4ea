"""Cross-layer transcoders at equal tokens: our trainer (``architecture = "clt"``, its
shipped defaults) against EleutherAI sparsify's cross-layer training (``cross_layer``, on
its ``clt`` branch: a ``SparseCoder`` per layer with a decoder to every later layer, run
by its ``CrossLayerRunner``), on the same synthetic multi-layer MLP-like activations,
held-out FVU per layer and training tokens/s of each.

    python -m benchmarks clt_quality
    CLT_QUALITY_TOKENS=524288 CLT_QUALITY_TRAINERS=ours,ours-batchtopk python -m benchmarks clt_quality
    CLT_QUALITY_SIGMAS=0,0.5,1 CLT_QUALITY_TRAINERS=ours python -m benchmarks clt_quality

``CLT_QUALITY_TRAINERS`` picks among ``ours``, ``ours-batchtopk`` (``clt_activation =
"batchtopk"``) and ``sparsify`` (default: ``ours,sparsify``). ``CLT_QUALITY_SIGMAS``: the
log-sd of the atoms' log-normal magnitudes, one data set each (default 1): how far apart
a row's atoms are in size, which is what separates a per-row top-k from per-latent
thresholds (``docs/BENCHMARKS.md``).

sparsify's cross-layer code is not on PyPI (its releases, 1.3.0 included, have no
``cross_layer``): it runs when a checkout of its ``clt`` branch is importable, otherwise
only ours is measured and the table says so. ``SETUP`` is how the venv of baselines
(``.venv-baselines``, which sees ``.venv``'s packages) gets it and circuit-tracer.

The data (``clt_layers``, made by ``common.clt_layers``, the one generator of the CLT
benchmarks): ``LAYERS`` MLP-like layers of width ``D``. Layer l's input is its own
sparse code (``ACTIVE`` of ``4 D`` atoms per token, log-normal magnitudes, sigma 1)
through a random unit-norm dictionary, plus a large per-layer mean and noise; layer t's
output is written by the codes of every layer at or below it (an earlier layer's at half
weight) -- the part a per-layer transcoder cannot see in its input and a CLT can.
Held-out rows are ``VAL_TOKENS`` other draws.

Both trainers read the same batches (our ``ActivationLoader``, same seed). sparsify's
step is its trainer's for ``loss_fn = "fvu"`` with its defaults: every layer's coder
seeded alike, Signum in ScheduleFree (momentum 0.95) at lr 5e-3 / sqrt(n / 2^14), no
schedule, ``encoder.bias = -W mean(x)`` and ``b_decs.0 = mean(y)`` from the first batch,
trained ``post_encs``, no AuxK; the loss the sum of the layers' FVUs (its per-layer
backward passes accumulate the same gradients). Its encoder's ``torch.compile`` and
Triton decoder are off (a CPU: the eager twins, the same maths). Train tokens/s is the
whole training call's (initialisation and, for ours, the threshold calibration included;
the top-k training's rows stop where the thresholds' fine-tune starts, the fine-tuned
rows include it). Every model is scored by one function on the held-out rows: per layer
``sum (y - y_hat)^2 / sum (y - mean y)^2``, each predicting with its own code (ours: top
k per layer per row, and also its JumpReLU thresholds -- what circuit-tracer runs --, of
the top-k training's CLT with its calibrated thresholds and of the file after the
thresholds' fine-tune, ``architectures/clt.py``; sparsify's: its runner, ``post_encs``
included), and the held-out L0 per layer of each code.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from .common import clt_layers as synthetic_layers
from .common import table

LAYERS, D, N_LATENTS, K, BATCH = 4, 128, 1024, 16, 4096
ACTIVE, VAL_TOKENS, TOKENS = 8, 16_384, 262_144


SETUP = """\
python -m venv .venv-baselines
echo "import site; site.addsitedir('$PWD/.venv/lib/python3.11/site-packages')" \\
  > .venv-baselines/lib/python3.11/site-packages/main-venv.pth
# circuit-tracer 0.5.0 pins transformers<=4.57.3 (and nnsight, transformer-lens) for its
# replacement model; its transcoder loaders need none of them
.venv-baselines/bin/pip install --no-deps circuit-tracer==0.5.0
.venv-baselines/bin/pip install --no-deps 'git+https://github.com/EleutherAI/sparsify@clt'
.venv-baselines/bin/pip install einops natsort schedulefree simple-parsing datasets triton
.venv-baselines/bin/python -m benchmarks clt_quality"""


def clt_layers(
    root: Path, *, tokens: int, sigma: float = 1.0, seed: int = 0
) -> dict[str, list[str]]:
    """The layers' inputs and outputs (``common.clt_layers`` at this module's sizes)."""
    return synthetic_layers(root, layers=LAYERS, width=D, atoms=4 * D, active=ACTIVE,
                            tokens=tokens, val_tokens=VAL_TOKENS, sigma=sigma, seed=seed)  # fmt: skip


def _config(paths, tokens: int, seed: int, out: Path):
    from pyspark_safetensors.sae import SAEConfig

    return SAEConfig(architecture="clt", datasets=tuple(paths["train_x"]),
                     target_datasets=tuple(paths["train_y"]), n_latents=N_LATENTS, k=K,
                     batch_size=BATCH, tokens=tokens, seed=seed, out_dir=str(out),
                     checkpoints=0, progress=False, plots=False, log_every=10_000)  # fmt: skip


def train_ours(paths, tokens: int, seed: int, out: Path, **overrides):
    """Our trainer's run: its file's CLT; and, when the thresholds are trained (the
    default), ``before``: the CLT as the top-k training left it, with the least-error
    calibrated thresholds ``clt_thresholds = "calibrated"`` would store (a copy taken as
    the fine-tune starts), and the seconds of each part."""
    import copy
    import dataclasses

    from pyspark_safetensors.sae import load_sae_model
    from pyspark_safetensors.sae.train import Trainer

    trainer = Trainer(dataclasses.replace(_config(paths, tokens, seed, out), **overrides))
    begin, before = trainer.sae.begin_threshold_training, {}
    started = time.perf_counter()

    def snapshot(*args, **kwargs):  # the fine-tune's start: keep the top-k training's CLT
        before["seconds"] = time.perf_counter() - started
        trainer.calibrate()  # the least-error cut (the fine-tune starts from frequency matching)
        before["model"] = copy.deepcopy(trainer.sae).eval()
        trainer.calibrate(least_error=False)
        begin(*args, **kwargs)

    trainer.sae.begin_threshold_training = snapshot
    trainer.fit()
    model = load_sae_model(out / "sae.safetensors")
    model.before = before.get("model")
    model.seconds = (before.get("seconds"), time.perf_counter() - started)
    return model


def train_ours_batchtopk(paths, tokens: int, seed: int, out: Path):
    """Ours with ``clt_activation = "batchtopk"`` (a batch-level selection in training,
    nearer to the thresholds' per-latent rule)."""
    return train_ours(paths, tokens, seed, out, clt_activation="batchtopk")


def _batches(config, steps: int):
    """``steps`` ``(xs, ys)`` batches (a list of L ``[B, D]`` each) in our trainer's order."""
    from pyspark_safetensors.sae.sources import open_source
    from pyspark_safetensors.torch import ActivationLoader

    source = open_source(config)
    loader = ActivationLoader(source.dataset, BATCH, columns=source.columns, seed=config.seed,
                              drop_last=True, dp_rank=0, dp_size=1)  # fmt: skip
    done = 0
    while done < steps:
        for batch in loader:
            x, y = source.pair(batch)
            yield list(x.float().split(D, dim=1)), list(y.float().split(D, dim=1))
            done += 1
            if done == steps:
                return


def train_sparsify(paths, tokens: int, seed: int, out: Path):
    """sparsify's cross-layer step (module docstring); the coders, averaged weights."""
    os.environ.setdefault("SPARSIFY_DISABLE_TRITON", "1")  # read when sparsify is imported
    from schedulefree import ScheduleFreeWrapper
    from sparsify import CrossLayerRunner, SparseCoder, SparseCoderConfig
    from sparsify.sign_sgd import SignSGD

    torch._dynamo.config.disable = True
    coders = []
    for pos in range(LAYERS):  # its trainer: cross_layer = L, every coder seeded alike
        torch.manual_seed(seed)
        cfg = SparseCoderConfig(num_latents=N_LATENTS, k=K, transcode=True,
                                n_targets=LAYERS - pos, n_sources=pos + 1)  # fmt: skip
        coders.append(SparseCoder(D, cfg, device="cpu", dtype=torch.float32))
    lr = 5e-3 / (N_LATENTS / 2**14) ** 0.5
    opt = ScheduleFreeWrapper(SignSGD([{"params": c.parameters(), "lr": lr} for c in coders]),
                              momentum=0.95)  # fmt: skip
    opt.train()
    for step, (xs, ys) in enumerate(_batches(_config(paths, tokens, seed, out), tokens // BATCH)):
        if step == 0:
            with torch.no_grad():
                for c, x, y in zip(coders, xs, ys, strict=True):
                    c.encoder.bias.copy_(-(x.mean(0) @ c.encoder.weight.T))
                    c.b_decs[0].copy_(y.mean(0))
        runner, loss = CrossLayerRunner(), 0.0
        for t, c in enumerate(coders):
            loss = loss + runner(xs[t], ys[t], c, f"layers.{t}.mlp").fvu
        loss.backward()
        opt.step()
        opt.zero_grad()
    opt.eval()  # ScheduleFree: the averaged weights are the model
    return coders


def _predict_sparsify(coders, xs, ys):
    from sparsify import CrossLayerRunner

    runner = CrossLayerRunner()
    return [runner(xs[t], ys[t], c, f"layers.{t}.mlp").sae_out for t, c in enumerate(coders)]


def held_out_fvus(predict, paths) -> list[float]:
    """Each layer's FVU over the held-out rows; ``predict(xs, ys)`` gives the L outputs."""
    import dataclasses

    config = dataclasses.replace(_config(paths, VAL_TOKENS, 0, Path(".")),
                                 datasets=tuple(paths["val_x"]),
                                 target_datasets=tuple(paths["val_y"]))  # fmt: skip
    means = _column_means(config)
    err, total = torch.zeros(LAYERS, dtype=torch.float64), torch.zeros(LAYERS, dtype=torch.float64)
    with torch.no_grad():
        for xs, ys in _batches(config, VAL_TOKENS // BATCH):
            for t, (y, y_hat) in enumerate(zip(ys, predict(xs, ys), strict=True)):
                err[t] += (y.double() - y_hat.double()).pow(2).sum()
                total[t] += (y.double() - means[t]).pow(2).sum()
    return (err / total).tolist()


def _column_means(config) -> torch.Tensor:
    """Each layer's held-out target mean ``[L, D]`` (float64)."""
    sums = torch.zeros(LAYERS, D, dtype=torch.float64)
    rows = 0
    for _, ys in _batches(config, VAL_TOKENS // BATCH):
        for t, y in enumerate(ys):
            sums[t] += y.double().sum(0)
        rows += len(ys[0])
    return sums / rows


def held_out_l0(model, paths, rule: str) -> float:
    """The mean over layers of ``rule``'s held-out L0 per layer."""
    import dataclasses

    config = dataclasses.replace(_config(paths, VAL_TOKENS, 0, Path(".")),
                                 datasets=tuple(paths["val_x"]),
                                 target_datasets=tuple(paths["val_y"]))  # fmt: skip
    fired = rows = 0
    with torch.no_grad():
        for xs, _ in _batches(config, VAL_TOKENS // BATCH):
            fired += sum(int((model.encode_layer(t, x, rule=rule) > 0).sum())
                         for t, x in enumerate(xs))  # fmt: skip
            rows += len(xs[0])
    return fired / rows / LAYERS


def measure(name: str, paths, tokens: int, seed: int = 0) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        model = TRAINERS[name](paths, tokens, seed, Path(tmp) / "model")
        seconds = time.perf_counter() - started
    speed = tokens / seconds
    if name == "sparsify":
        return [{"trainer": "sparsify (cross_layer)", "tokens_per_s": speed, "l0": K,
                 "fvu": held_out_fvus(lambda xs, ys: _predict_sparsify(model, xs, ys), paths)}]  # fmt: skip
    label = "clt, batchtopk" if name == "ours-batchtopk" else "clt"
    before, (topk_s, total_s) = model.before, model.seconds
    # the top-k training's CLT and its calibrated thresholds; the file's after the fine-tune
    models = [("", model)] if before is None else [("", before), (", fine-tuned", model)]
    rows = []
    for suffix, m in models:
        for rule in ("topk", "threshold"):
            what = "top-k rule" if rule == "topk" else (
                "trained thresholds" if suffix else "calibrated thresholds")  # fmt: skip
            rows.append({
                "trainer": f"ours ({label}{suffix}, {what})",
                "tokens_per_s": tokens / topk_s if before is not None and not suffix else speed,
                "fvu": held_out_fvus(lambda xs, ys, m=m, r=rule: m.forward_layers(xs, rule=r), paths),
                "l0": held_out_l0(m, paths, rule),
            })  # fmt: skip
    if before is not None:
        print(f"seconds: top-k training {topk_s:.1f}, with the fine-tune {total_s:.1f}", flush=True)
    return rows


TRAINERS = {"ours": train_ours, "ours-batchtopk": train_ours_batchtopk, "sparsify": train_sparsify}


def _has_sparsify_clt() -> bool:
    spec = importlib.util.find_spec("sparsify")
    places = (spec and spec.submodule_search_locations) or []
    return any((Path(place) / "runner.py").is_file() for place in places)


def run() -> str:
    tokens = int(os.environ.get("CLT_QUALITY_TOKENS", TOKENS))
    names = [n.strip() for n in os.environ.get("CLT_QUALITY_TRAINERS", "ours,sparsify").split(",")]
    sigmas = [float(s) for s in os.environ.get("CLT_QUALITY_SIGMAS", "1").split(",")]
    missing = [n for n in names if n == "sparsify" and not _has_sparsify_clt()]
    rows = []
    for sigma in sigmas:
        with tempfile.TemporaryDirectory() as tmp:
            paths = clt_layers(Path(tmp) / "data", tokens=tokens, sigma=sigma)
            for name in names:
                if not name or name in missing:
                    continue
                for m in measure(name, paths, tokens):
                    fvu = m["fvu"]
                    rows.append([f"{sigma:g}", m["trainer"], *(f"{v:.4f}" for v in fvu),
                                 f"{np.mean(fvu):.4f}", f"{m['l0']:.2f}",
                                 f"{m['tokens_per_s']:,.0f}"])  # fmt: skip
                    print(rows[-1], flush=True)
    note = " sparsify's cross-layer code is not installed: not measured." if missing else ""
    header = ["magnitude log-sd", "trainer", *(f"FVU layer {t}" for t in range(LAYERS)), "mean FVU",
              "L0 per layer", "train tokens/s"]  # fmt: skip
    return (
        f"## Cross-layer transcoders against sparsify's cross_layer\n\n"
        f"Synthetic MLP-like layers (`bench_clt_quality.clt_layers`): {LAYERS} layers of width "
        f"{D}, {4 * D} atoms per layer, {ACTIVE} active per token (log-normal magnitudes of "
        f"log-sd {', '.join(f'{s:g}' for s in sigmas)}), each layer's output "
        f"written by the codes of every layer at or below it. {N_LATENTS} latents per layer, "
        f"k = {K} per layer, batch {BATCH:,}, {tokens:,} training tokens, both trainers on the "
        f"same batches; held-out FVU per layer on {VAL_TOKENS:,} other tokens, one scoring "
        f"function for both, and the held-out L0 per layer (the mean over the layers); "
        f"train tokens/s of the whole training call (ours: the top-k training's rows up to "
        f"the thresholds' fine-tune, the fine-tuned rows with it). Ours: the top-k "
        f"training's CLT under the top k per row and under its calibrated thresholds "
        f'(`clt_thresholds = "calibrated"`), then the file after the thresholds\' '
        f"fine-tune (the default, `clt_threshold_fraction` of the tokens again) under both "
        f"rules.{note} The venv of baselines:\n\n```\n{SETUP}\n```\n\n" + table(header, rows)
    )
