"""Our SAE trainer against SAELens' SynthSAEBench runner (sae-lens 6.54,
``sae_lens.synthetic``) on one synthetic model and the same samples, every SAE graded by
one function (``evaluate_ground_truth``, equal to SAELens' ``eval_sae_on_synthetic_data``
to 1e-4) on one evaluation set.

    python -m benchmarks synth                  # needs sae-lens: .venv-baselines
    SYNTH_SAMPLES=65536 SYNTH_FAMILIES=topk SYNTH_LRS=3e-4,3e-3 python -m benchmarks synth
    SYNTH_SEEDS=1,2,3 SYNTH_JOBS=2 python -m benchmarks synth     # the seed spread

Environment: ``SYNTH_SAMPLES`` training samples (default 524,288; a multiple of the batch;
4,194,304 or more runs the same way, a data set of about 7 GB under ``out/bench_synth`` and
about eight times the CPU of the default), ``SYNTH_FAMILIES`` (``topk``, ``batchtopk``,
``jumprelu``, ``matryoshka``), ``SYNTH_LRS`` (SAELens' sweep, default
``3e-4,1e-3,3e-3,1e-2``; its runner's shipped rate, 3e-4, is always trained),
``SYNTH_EVAL`` (evaluation samples, default 50,000), ``SYNTH_SEEDS`` (the trainers'
seeds, default 1: each seed draws both trainers' initial weights and sample order, and the
table gives mean ± sd over them), ``SYNTH_JOBS`` (training processes at a time, default 1;
each trains one family and seed, ours then SAELens at each rate), ``SYNTH_TRAINERS``
(``ours,saelens`` by default; ``ours`` retrains ours alone after a change to our trainer
and keeps SAELens' rows of the same family, seed and size from an earlier run: SAELens'
figures do not depend on our code, and both read the same rows in the same order by
construction, which the earlier run checked). The default size updates the doc's
``synth`` block, another size its own (``synth-4194304``).

The model: SynthSAEBench-16k's recipe scaled down as ``docs/evaluation.md`` gives it,
4,096 true features in 256 dimensions (Zipfian firing, 128 trees of branching 4 and depth
2 with mutually exclusive children, orthogonalised directions, a rank-32 correlation of
the firings), model seed 0. Its samples are drawn in this process as
``write_synthetic_dataset`` draws them (partition ``p`` of 65,536 rows from the generator
of ``(seed, p)``, ``job.draw_rows``), so the rows are the ones that Spark job writes, and
written once as a synthetic dataset (training seed 0, evaluation seed 1) under
``out/bench_synth/model-{hash}`` (the model, then a folder per set and size), reused by
later runs.

The same samples in the same order: our ``Trainer`` reads the training set through its
``ActivationLoader`` (seed 1, batch 1,024, one pass: every sample once, as the runner
draws a fresh sample every step). SAELens' runner draws its batches from the model
in-process (``SyntheticActivationIterator``); here its ``SAETrainer`` gets, in place of
that iterator, an iterator over the same loader built with the same arguments (seed 1,
batch 1,024, ``drop_last``), and everything else of the runner as it ships: the trainer
configuration of ``SyntheticSAERunnerConfig(...).to_sae_trainer_config()`` (Adam 0.9/0.999,
constant rate, batch 1,024, no warm-up, decay or normalisation) and the SAE built as the
runner builds it (``get_sae_training_class``). Both trainers' batches are hashed as they
are consumed and the two sequences must be equal: the run fails otherwise.

Both trainers train at width 1,024 and k 12, seed 1 by default (the model's is 0; our trainer's
initial weights are drawn apart from any other use of a seed, ``init_generator``). Ours at its shipped defaults
(rate ``2.8e-3 / sqrt(1024 / 16384)``, Adam 0.8/0.98, warm-up and decay, AuxK,
geometric-median ``b_dec``; Matryoshka's prefixes n/16 ... n) but the batch, 1,024 like
SAELens' runner, not its 4,096, so that both take the same steps. JumpReLU: ours pulls
its mean L0 to k by its penalty ``(L0 / k - 1)^2``; SAELens' by its ``quadratic``
sparsity loss (Gemma Scope 2's) at ``target_l0 = 12`` and its default coefficient 1:
neither needs a search to land near 12. SAELens' Matryoshka is its
``matryoshka_batchtopk`` with our prefixes as its widths (64, 128, 256, 512, 1,024).

Speed: samples per second of CPU time of the process (``time.process_time()``) over each
trainer's whole training call (construction, initialisation and steps, the shared
loader's reads included for both), with ``torch.set_num_threads(1)``, so other jobs on
the machine do not change the ratio; the wall time is printed beside it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import tempfile
import time
import zlib
from pathlib import Path

import torch

from .common import table

F, H, N_LATENTS, K, BATCH = 4096, 256, 1024, 12, 1024
MODEL_SEED, TRAIN_DATA_SEED, EVAL_DATA_SEED, TRAINER_SEED = 0, 0, 1, 1
ROWS_PER_PARTITION, ROWS_PER_SHARD = 65_536, 16_384
SHIPPED_LR = 3e-4  # SyntheticSAERunnerConfig.lr
FAMILIES = ("topk", "batchtopk", "jumprelu", "matryoshka")
CACHE = Path(__file__).resolve().parent.parent / "out" / "bench_synth"


def model_config():
    """SynthSAEBench-16k's recipe at 4,096 features in 256 dimensions (``docs/evaluation.md``)."""
    from pyspark_safetensors.evaluation import (
        HierarchyConfig,
        LowRankCorrelationConfig,
        OrthogonalizationConfig,
        SyntheticModelConfig,
    )

    return SyntheticModelConfig(
        num_features=F, hidden_dim=H, seed=MODEL_SEED,
        hierarchy=HierarchyConfig(total_root_nodes=128, branching_factor=4, max_depth=2,
                                  mutually_exclusive_portion=1.0),
        orthogonalization=OrthogonalizationConfig(),
        correlation=LowRankCorrelationConfig(),
    )  # fmt: skip


def write_samples(model, out: Path, rows: int, seed: int) -> None:
    """``rows`` samples of ``model`` as ``write_synthetic_dataset`` draws and lays them out
    (same partitions, generators, ``max_active`` and columns), written from this process."""
    import numpy as np

    from pyspark_safetensors.dataset.build import DatasetBuilder
    from pyspark_safetensors.evaluation.job import choose_max_active, draw_rows

    max_active = choose_max_active(model, seed)
    metadata = {"synthetic_model": json.dumps(model.config.to_dict()),
                "synthetic_seed": str(seed), "max_active": str(max_active)}  # fmt: skip
    with DatasetBuilder(out, batch_size=ROWS_PER_SHARD, metadata=metadata, overwrite=True) as b:
        for p in range(-(-rows // ROWS_PER_PARTITION)):
            start = p * ROWS_PER_PARTITION
            stop = min(start + ROWS_PER_PARTITION, rows)
            parts = []
            for columns in draw_rows(model, seed, p, start, stop, max_active):
                parts.append(columns)
                if sum(len(c["row"]) for c in parts) >= ROWS_PER_SHARD:
                    b.add_batch({k: np.concatenate([c[k] for c in parts]) for k in columns})
                    parts = []
            if parts:
                b.add_batch({k: np.concatenate([c[k] for c in parts]) for k in parts[0]})


def data(samples: int, eval_rows: int) -> dict[str, Path]:
    """The model (built once: its orthogonalisation takes minutes of one core) and its
    training and evaluation sets (once per size)."""
    from pyspark_safetensors.evaluation import SyntheticModel

    config = model_config()
    key = hashlib.sha256(json.dumps(config.to_dict()).encode()).hexdigest()[:12]
    root = CACHE / f"model-{key}"
    paths = {"model": root / "model", "train": root / f"train-{samples}-seed{TRAIN_DATA_SEED}",
             "eval": root / f"eval-{eval_rows}-seed{EVAL_DATA_SEED}"}  # fmt: skip
    started = time.perf_counter()
    if not (paths["model"] / "synthetic_model.safetensors").is_file():
        SyntheticModel.build(config).save(paths["model"])
    model = SyntheticModel.load(paths["model"])
    for split, rows, seed in (("eval", eval_rows, EVAL_DATA_SEED),
                              ("train", samples, TRAIN_DATA_SEED)):  # fmt: skip
        if not (paths[split] / "dataset_manifest.json").is_file():
            write_samples(model, paths[split], rows, seed)
    print(f"data: {time.perf_counter() - started:.0f} s", flush=True)
    return paths


class Recorded:
    """An iterable of batches that records a CRC of each batch's bytes as it is consumed."""

    def __init__(self, batches, digests: list[int], key: str | None = None):
        self.batches, self.digests, self.key = batches, digests, key

    def __len__(self):
        return len(self.batches)

    def __getattr__(self, name):  # the loader's state_dict and the rest
        return getattr(self.batches, name)

    def __iter__(self):
        for batch in self.batches:
            x = batch[self.key] if self.key else batch
            self.digests.append(zlib.crc32(x.contiguous().numpy().tobytes()))
            yield batch


def stream(train: Path, steps: int, seed: int):
    """``steps`` batches of the training set in the order our ``Trainer`` reads them
    (its loader, its arguments for one process)."""
    from pyspark_safetensors.torch import ActivationLoader, open_dataset

    loader = ActivationLoader(open_dataset(train), BATCH, columns=["activation"],
                              seed=seed, drop_last=True, dp_rank=0, dp_size=1)  # fmt: skip
    for step, batch in enumerate(loader):
        if step == steps:
            return
        yield batch["activation"]


def train_ours(family: str, train: Path, samples: int, out: Path, digests: list[int],
               seed: int):  # fmt: skip
    from pyspark_safetensors.sae import SAEConfig, load_sae_model
    from pyspark_safetensors.sae.train import Trainer

    config = SAEConfig(dataset=str(train), architecture=family, n_latents=N_LATENTS, k=K,
                       batch_size=BATCH, tokens=samples, seed=seed, out_dir=str(out),
                       checkpoints=0, progress=False, plots=False, log_every=100_000)  # fmt: skip
    trainer = Trainer(config)
    trainer.loader = Recorded(trainer.loader, digests, "activation")
    trainer.fit()
    return trainer.learning_rate, lambda: load_sae_model(out / "sae.safetensors")


def saelens_sae_config(family: str):
    from sae_lens import (
        BatchTopKTrainingSAEConfig,
        JumpReLUTrainingSAEConfig,
        MatryoshkaBatchTopKTrainingSAEConfig,
        TopKTrainingSAEConfig,
    )

    from pyspark_safetensors.sae.config import default_prefixes

    if family == "topk":
        return TopKTrainingSAEConfig(d_in=H, d_sae=N_LATENTS, k=K)
    if family == "batchtopk":
        return BatchTopKTrainingSAEConfig(d_in=H, d_sae=N_LATENTS, k=K)
    if family == "jumprelu":
        return JumpReLUTrainingSAEConfig(d_in=H, d_sae=N_LATENTS, target_l0=K,
                                         jumprelu_sparsity_loss_mode="quadratic")  # fmt: skip
    return MatryoshkaBatchTopKTrainingSAEConfig(
        d_in=H, d_sae=N_LATENTS, k=K, matryoshka_widths=list(default_prefixes(N_LATENTS, K))
    )


def train_saelens(family: str, lr: float, model_dir: Path, train: Path, samples: int, out: Path,
                  digests: list[int], seed: int):  # fmt: skip
    """SAELens' SynthSAEBench runner's training (``SyntheticSAERunner.run`` up to its
    ``trainer.fit()``) with our stream in place of its in-process draws."""
    from sae_lens.config import LoggingConfig
    from sae_lens.registry import get_sae_training_class
    from sae_lens.synthetic import SyntheticSAERunnerConfig
    from sae_lens.training.sae_trainer import SAETrainer

    from pyspark_safetensors.sae import load_sae_model

    cfg = SyntheticSAERunnerConfig(synthetic_model=str(model_dir), sae=saelens_sae_config(family),
                                   training_samples=samples, batch_size=BATCH, lr=lr,
                                   output_path=None, checkpoint_path=None, eval_samples=0,
                                   logger=LoggingConfig(log_to_wandb=False))  # fmt: skip
    torch.manual_seed(seed)
    sae_class, _ = get_sae_training_class(cfg.sae.architecture())
    sae = sae_class(cfg.sae)
    batches = iter(Recorded(stream(train, samples // BATCH, seed), digests))
    SAETrainer(cfg=cfg.to_sae_trainer_config(), sae=sae, data_provider=batches).fit()
    sae.save_inference_model(str(out))
    return lr, lambda: load_sae_model(out)


def timed(fn, *args):
    """``fn(*args)``'s result, its process CPU seconds and its wall seconds."""
    cpu, wall = time.process_time(), time.perf_counter()
    result = fn(*args)
    return result, time.process_time() - cpu, time.perf_counter() - wall


HEADER = ["family", "trainer", "lr", "MCC", "F1", "L0", "dead", "explained var.",
          "samples/s (CPU)", "ours / SAELens (CPU)", "wall s"]  # fmt: skip
_GRADER = {}  # per process: the model and the evaluation set, read once


def grade(paths: dict[str, Path], load):
    from pyspark_safetensors.evaluation import (
        SyntheticModel,
        evaluate_ground_truth,
        ground_truth_batches,
    )

    if not _GRADER:
        _GRADER["model"] = SyntheticModel.load(paths["model"])
        _GRADER["evals"] = list(ground_truth_batches(paths["eval"], batch=4096))
    model = _GRADER["model"]
    return evaluate_ground_truth(load(), model.feature_vectors, _GRADER["evals"],
                                 parent_of=model.parent_of)  # fmt: skip


def train_family(family: str, seed: int, samples: int, lrs: list[float],
                 paths: dict[str, Path]) -> list[tuple]:  # fmt: skip
    """Ours and SAELens at each rate (no rates: ours alone) on one family and seed, each
    graded: rows of ``(family, trainer, lr, seed, metrics, cpu s, wall s)``."""
    torch.set_num_threads(1)
    # imported before any timing: neither trainer's first call pays for its imports
    import sae_lens.synthetic
    import sae_lens.training.sae_trainer  # noqa: F401

    import pyspark_safetensors.sae.train  # noqa: F401

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ours: list[int] = []
        (lr, load), cpu, wall = timed(train_ours, family, paths["train"], samples,
                                      Path(tmp) / "ours", ours, seed)  # fmt: skip
        rows.append((family, "ours (defaults)", lr, seed, grade(paths, load), cpu, wall))
        print(family, "ours", seed, f"MCC {rows[-1][4].mcc:.3f}", f"{cpu:.0f} s CPU", flush=True)
        for lr in lrs:
            theirs: list[int] = []
            (_, load), cpu, wall = timed(train_saelens, family, lr, paths["model"],
                                         paths["train"], samples, Path(tmp) / f"sl-{lr:g}",
                                         theirs, seed)  # fmt: skip
            if theirs != ours:
                raise AssertionError(
                    f"{family}: SAELens read {len(theirs)} batches, ours {len(ours)}, not "
                    "the same rows in the same order"
                )
            rows.append((family, "SAELens", lr, seed, grade(paths, load), cpu, wall))
            print(family, f"SAELens {lr:g}", seed, f"MCC {rows[-1][4].mcc:.3f}",
                  f"{cpu:.0f} s CPU", flush=True)  # fmt: skip
    return rows


def spread(values, digits: int, sep: bool = False) -> str:
    """``mean`` or ``mean ± sd`` over seeds."""
    import numpy as np

    mean = float(np.mean(values))
    text = f"{mean:,.{digits}f}" if sep else f"{mean:.{digits}f}"
    if len(values) > 1:
        sd = float(np.std(values, ddof=1))
        text += f" ± {sd:,.{digits}f}" if sep else f" ± {sd:.{digits}f}"
    return text


def block() -> str:
    """This run's block of ``docs/BENCHMARKS.md``: ``synth`` at the default size, else
    ``synth-{samples}``, so that each size's table stays."""
    samples = settings()[0]
    return "synth" if samples == 524_288 else f"synth-{samples}"


def settings():
    samples = int(os.environ.get("SYNTH_SAMPLES", 524_288)) // BATCH * BATCH
    seeds = [int(v) for v in os.environ.get("SYNTH_SEEDS", str(TRAINER_SEED)).split(",") if v]
    eval_rows = int(os.environ.get("SYNTH_EVAL", 50_000))
    families = [f for f in os.environ.get("SYNTH_FAMILIES", ",".join(FAMILIES)).split(",") if f]
    lrs = [float(v) for v in os.environ.get("SYNTH_LRS", "3e-4,1e-3,3e-3,1e-2").split(",") if v]
    jobs = int(os.environ.get("SYNTH_JOBS", 1))
    trainers = {t for t in os.environ.get("SYNTH_TRAINERS", "ours,saelens").split(",") if t}
    unknown = set(families) - set(FAMILIES)
    if unknown:
        raise ValueError(f"SYNTH_FAMILIES: unknown {sorted(unknown)}; choose among {FAMILIES}")
    if "ours" not in trainers or trainers - {"ours", "saelens"}:
        raise ValueError(f"SYNTH_TRAINERS: 'ours' or 'ours,saelens', got {sorted(trainers)}")
    lrs = sorted(set(lrs) | {SHIPPED_LR}) if "saelens" in trainers else []
    return samples, seeds, eval_rows, families, lrs, jobs


def stored(paths: dict[str, Path], samples: int) -> tuple[Path, list[dict]]:
    """The file that keeps every row measured at this size, beside the data, and its rows."""
    file = paths["train"].parent / f"results-{samples}.json"
    return file, json.loads(file.read_text()) if file.is_file() else []


def remember(paths: dict[str, Path], samples: int, results: list[tuple]) -> list[tuple]:
    """This run's rows with those of the families, seeds and trainers an earlier run
    measured at this size and this one did not (``results-{samples}.json`` beside the
    data), so that families, and ours alone, can be measured one run at a time; the
    metrics as attributes."""
    from types import SimpleNamespace

    file, old = stored(paths, samples)
    new = [{"family": f, "trainer": t, "lr": lr, "seed": s, "metrics": m.to_dict(), "cpu": c,
            "wall": w} for f, t, lr, s, m, c, w in results]  # fmt: skip

    def key(r):
        return r["family"], r["seed"], r["trainer"].startswith("ours")

    measured = {key(r) for r in new}
    kept = [r for r in old if key(r) not in measured] + new
    file.write_text(json.dumps(kept, indent=1) + "\n")
    return [(r["family"], r["trainer"], r["lr"], r["seed"], SimpleNamespace(**r["metrics"]),
             r["cpu"], r["wall"]) for r in kept]  # fmt: skip


def run() -> str:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    import numpy as np

    if importlib.util.find_spec("sae_lens") is None:
        raise ModuleNotFoundError(
            "synth trains SAELens' runner: run it with sae-lens 6.54 installed "
            "(.venv-baselines/bin/python -m benchmarks synth; bench_clt_quality.SETUP)"
        )
    samples, seeds, eval_rows, families, lrs, jobs = settings()
    ran, rates = families, lrs
    only_ours = "" if lrs else "SYNTH_TRAINERS=ours "
    paths = data(samples, eval_rows)
    if only_ours:  # SAELens' rows of every family and seed must be on file, before training
        have = {(r["family"], r["seed"]) for r in stored(paths, samples)[1]
                if r["trainer"] == "SAELens"}  # fmt: skip
        missing = [f"{f} seed {s}" for f in families for s in seeds if (f, s) not in have]
        if missing:
            raise ValueError(f"no SAELens rows at {samples:,} samples for {', '.join(missing)}:"
                             " run with SYNTH_TRAINERS=ours,saelens first")  # fmt: skip
    # the slowest family first, so that the processes finish together
    tasks = sorted(((f, s) for f in families for s in seeds),
                   key=lambda t: -FAMILIES.index(t[0]))  # fmt: skip
    results = []
    if jobs > 1:
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = [pool.submit(train_family, f, s, samples, lrs, paths) for f, s in tasks]
            for future in futures:
                results += future.result()
    else:
        for f, s in tasks:
            results += train_family(f, s, samples, lrs, paths)
    results = remember(paths, samples, results)
    families = [f for f in FAMILIES if any(r[0] == f for r in results)]
    true_l0 = results[0][4].true_l0

    def runs(family, who, lr=None):
        return [r for r in results if r[0] == family and r[1].startswith(who)
                and (lr is None or r[2] == lr)]  # fmt: skip

    def mean(rs, attr):
        return float(np.mean([getattr(r[4], attr) for r in rs]))

    def cpu(rs):
        return float(np.mean([r[5] for r in rs]))

    rows, words, trail, edge = [], [], [], []
    for family in families:
        lrs = sorted({r[2] for r in runs(family, "SAELens")})
        mine = runs(family, "ours")
        shipped = runs(family, "SAELens", SHIPPED_LR)
        best_lr = max(lrs, key=lambda lr: mean(runs(family, "SAELens", lr), "mcc"))
        best = runs(family, "SAELens", best_lr)
        for who, group in [("ours (defaults)", mine)] + [("SAELens", runs(family, "SAELens", lr))
                                                          for lr in lrs]:  # fmt: skip
            label = who
            if who == "SAELens":
                lr = group[0][2]
                marks = [s for s, hit in (("shipped lr", lr == SHIPPED_LR),
                                          ("best MCC", lr == best_lr)) if hit]  # fmt: skip
                label += f" ({', '.join(marks)})" if marks else ""
            ratio = "" if who == "SAELens" else spread([cpu(shipped) / r[5] for r in group], 2)
            rows.append([
                family, label, f"{group[0][2]:.2g}",
                spread([r[4].mcc for r in group], 3), spread([r[4].f1 for r in group], 3),
                spread([r[4].sae_l0 for r in group], 1),
                spread([r[4].dead_latents for r in group], 0),
                spread([r[4].explained_variance for r in group], 3),
                spread([samples / r[5] for r in group], 0, sep=True), ratio,
                f"{np.mean([r[6] for r in group]):.0f}",
            ])  # fmt: skip
        m = {a: mean(mine, a) for a in ("mcc", "f1", "explained_variance", "dead_latents")}
        b = {a: mean(best, a) for a in m}
        words.append(
            f"- {family}: MCC {m['mcc']:.3f} against SAELens' best {b['mcc']:.3f} (lr "
            f"{best_lr:.2g}; {m['mcc'] / b['mcc'] - 1:+.1%}) and its shipped rate's "
            f"{mean(shipped, 'mcc'):.3f} ({m['mcc'] / mean(shipped, 'mcc') - 1:+.1%}); F1 "
            f"{m['f1']:.3f} against {b['f1']:.3f}; explained variance "
            f"{m['explained_variance']:.3f} against {b['explained_variance']:.3f}; "
            f"{cpu(shipped) / cpu(mine):.2f}x SAELens' CPU speed."
        )
        for name, attr in (("MCC", "mcc"), ("F1", "f1"),
                           ("explained variance", "explained_variance")):  # fmt: skip
            if m[attr] < b[attr]:
                trail.append(f"{family} {name} {m[attr]:.3f} against {b[attr]:.3f} "
                             f"({m[attr] / b[attr] - 1:+.1%})")  # fmt: skip
        if m["dead_latents"] > b["dead_latents"]:
            trail.append(f"{family} dead latents {m['dead_latents']:.0f} against "
                         f"{b['dead_latents']:.0f}")  # fmt: skip
        if cpu(mine) > cpu(shipped):
            trail.append(f"{family} CPU speed {cpu(shipped) / cpu(mine):.2f}x SAELens'")
        if best_lr == max(lrs) and len(lrs) > 1:
            edge.append(f"{family} ({best_lr:g})")
    words.append(
        "- Where we trail (against SAELens' best-MCC rate; speed against its shipped one): "
        + ("; ".join(trail) if trail else "nowhere")
        + "."
    )
    if edge:
        words.append(
            f"- SAELens' best rate is the largest it was trained at for "
            f"{', '.join(edge)}: a larger one might do better still."
        )
    words.append(f"- {samples // BATCH:,} steps (SynthSAEBench trains on ~10^8 samples).")
    speed = np.median([samples / r[5] for r in results if r[1].startswith("ours")])
    others = [f for f in families if f not in ran]
    earlier = (f"; {', '.join(others)} from an earlier run at this size (`SYNTH_FAMILIES`), "
               f"kept in `results-{samples}.json` beside the data" if others else "")  # fmt: skip
    if not rates:  # SYNTH_TRAINERS=ours
        rates = sorted({r[2] for r in results if r[1] == "SAELens"})
        earlier += (f"; SAELens' rows from an earlier run at this size and seeds "
                    f"(`SYNTH_TRAINERS=ours`: ours retrained alone, SAELens' kept in "
                    f"`results-{samples}.json`)")  # fmt: skip

    every = sorted({r[3] for r in results})  # this run's seeds and those kept from earlier
    if every != sorted(seeds):
        before = [str(v) for v in every if v not in seeds]
        earlier += (f"; seed{'s' if len(before) > 1 else ''} {', '.join(before)} from earlier "
                    f"runs at this size")  # fmt: skip
    seeded = (f"seeds {', '.join(map(str, every))} (each: both trainers' initial weights and "
              f"sample order; mean ± sd over the seeds a row has)" if len(every) > 1
              else f"seed {every[0]}")  # fmt: skip
    return (
        f"## SAE trainers on SynthSAEBench's synthetic model: ours against SAELens "
        f"({samples:,} samples{f', {len(every)} seeds' if len(every) > 1 else ''})\n\n"
        f"`SYNTH_SAMPLES={samples} SYNTH_SEEDS={','.join(map(str, seeds))} "
        f"SYNTH_FAMILIES={','.join(ran)} SYNTH_LRS={','.join(f'{v:g}' for v in rates)} "
        f"SYNTH_JOBS={jobs} {only_ours}python -m benchmarks synth` (sae-lens installed: "
        f"`.venv-baselines`){earlier}. The model: SynthSAEBench-16k's recipe at {F:,} features in {H} "
        f"dimensions (mean true L0 {true_l0:.1f} on the evaluation set), {samples:,} training "
        f"samples read once by both trainers in the same order (checked batch by batch"
        f"{' in the run that trained SAELens' if only_ours else ''}), "
        f"{N_LATENTS:,} latents, k = {K} (JumpReLU: its target L0), batch {BATCH}, {seeded}; "
        f"ours at its shipped defaults, SAELens' runner at its shipped rate ({SHIPPED_LR:g}) "
        f"and at each rate of the sweep (its best: the highest mean MCC). Every SAE graded by "
        f"`evaluate_ground_truth` on the same {eval_rows:,} evaluation samples (another "
        f"seed). Samples/s: process CPU time of the training call with one torch thread "
        f"(ours: median {speed:,.0f}), {jobs} training process{'es' if jobs > 1 else ''} at "
        f"a time; the ratio is against SAELens at its shipped rate. How the samples are "
        f"shared and each family set up: the module's docstring.\n\n"
        + table(HEADER, rows)
        + "\n\n"
        + "\n".join(words)
    )
