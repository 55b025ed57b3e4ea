"""SAE quality over a grid of SAEs: ``run_sweep(spark, SweepConfig)`` (the ``sweep``
command, ``conf/sweep-synth.toml``).

1. A synthetic model and its training and evaluation sets (``synthetic_datasets``), stage
   ``data-{hash}``.
2. One SAE per point of the grid families x widths x k x seeds, each trained by our
   ``Trainer`` in this process, one after another, into ``saes/{name}-{hash}`` (the hash of
   its ``SAEConfig`` and of the data's); a rerun reuses every SAE whose directory exists.
3. Their evaluation as one Spark job with one task per SAE (``evaluate_in_spark``): each
   task loads its SAE file, streams the evaluation rows through ``evaluate_ground_truth``
   and runs SAEBench's sparse probing (``probing.py``) on the first rows, tasks "does true
   feature f fire" chosen on the driver, which also probes the raw activations (the
   baseline). ``evaluate_in_loop`` is the same work in one process, SAE after SAE.
4. ``eval-{hash}``: ``results.parquet`` (a row per SAE), ``results.json`` (the same with
   each probe task and each parent's absorption, the baseline and the configuration),
   ``report.md`` (the leaderboard: mean ± sd over seeds) and the Pareto plots
   ``pareto-{metric}.png`` (L0 against MCC, F1, FVU, absorption, probe accuracy);
   ``out/eval`` links to the newest.

Every stage directory is built under a staging name and published whole, so a directory
that exists is complete.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from ..dataset.publish import publishing
from ..format.errors import InvalidArgumentError
from .synthetic import HierarchyConfig, SyntheticModelConfig

#: The SAE families a sweep trains (``SAEConfig.architecture``).
FAMILIES = ("topk", "batchtopk", "jumprelu", "matryoshka")
#: ``SAEConfig`` fields the grid sets; the ``[sae]`` table may not.
GRID_FIELDS = ("dataset", "out_dir", "n_latents", "k", "architecture", "seed")
#: The figures of the leaderboard and the plots: (key, heading, higher is better).
FIGURES = (
    ("sae_l0", "L0", None),
    ("mcc", "MCC", True),
    ("f1", "F1", True),
    ("fvu", "FVU", False),
    ("dead_latents", "dead", False),
    ("absorption", "absorption", False),
)

#: SAEBench's core figures in a sweep's rows and report: (key, heading, format).
CORE_FIGURES = (
    ("cossim", "cos sim", ".3f"),
    ("l2_ratio", "L2 ratio", ".3f"),
    ("relative_reconstruction_bias", "rel. bias", ".3f"),
    ("l1", "L1", ".2f"),
    ("frac_alive", "alive", ".3f"),
    ("freq_over_1_percent", "> 1 %", ".3f"),
    ("average_max_encoder_cosine_sim", "max enc. cos", ".3f"),
    ("average_max_decoder_cosine_sim", "max dec. cos", ".3f"),
)


def _default_model() -> SyntheticModelConfig:
    return SyntheticModelConfig(
        num_features=1024, hidden_dim=64,
        hierarchy=HierarchyConfig(total_root_nodes=32, branching_factor=4, max_depth=1,
                                  mutually_exclusive_portion=1.0),
    )  # fmt: skip


@dataclass(frozen=True)
class SweepConfig:
    """A sweep (module docstring). From TOML: ``SweepConfig.load(path)``, top-level keys
    (or a ``[sweep]`` table), the synthetic model in ``[model]`` (SAELens' JSON form:
    ``SyntheticModelConfig.from_dict``) and extra trainer settings in ``[sae]``."""

    out: str = "runs/sweep"
    """Directory of the stages, the results and the report."""
    model: SyntheticModelConfig = field(default_factory=_default_model)
    """The synthetic model whose samples the SAEs learn."""
    train_rows: int = 65_536
    """Rows of the training set."""
    eval_rows: int = 16_384
    """Rows of the evaluation set (every one in the ground-truth figures)."""
    data_seed: int = 0
    """Seed of the training rows (the evaluation rows: data_seed + 1)."""
    rows_per_partition: int = 16_384
    """Rows of one Spark task of the data generation."""
    families: tuple[str, ...] = FAMILIES
    """SAE families of the grid (topk, batchtopk, jumprelu, matryoshka)."""
    widths: tuple[int, ...] = (512,)
    """Latent counts of the grid."""
    ks: tuple[int, ...] = (8,)
    """Active latents per row of the grid (JumpReLU: its target L0)."""
    seeds: tuple[int, ...] = (0, 1)
    """Training seeds of the grid (the spread over seeds is reported)."""
    tokens: int = 0
    """Training rows each SAE sees (0: one pass over the training set)."""
    batch_size: int = 1024
    """Training batch."""
    sae: dict = field(default_factory=dict)
    """More ``SAEConfig`` settings for every SAE (not those the grid sets)."""
    train_threads: int = 0
    """torch threads of the training (0: torch's default; 1 is faster for small SAEs,
    whose steps are too short to share)."""
    eval_batch: int = 4096
    """Rows per batch of the evaluation."""
    probe_train_rows: int = 3000
    """Sparse probing: the first rows of the evaluation set are the probes' training
    pool, the next ``probe_test_rows`` their test pool."""
    probe_test_rows: int = 1000
    probe_tasks: int = 8
    """Probe tasks: true features spread over the ranks of firing frequency."""
    probe_features: tuple[int, ...] = ()
    """The true features to probe instead (empty: chosen as ``probe_tasks`` says)."""
    probe_ks: tuple[int, ...] = (1, 2, 5)
    """k of the sparse probes (SAEBench's 1, 2, 5)."""
    probe_min_positives: int = 20
    """Least positives (and negatives) a task's feature has in each probe split."""
    progress: bool = True
    """Progress bars."""

    def __post_init__(self):
        for name in ("widths", "ks", "seeds", "families", "probe_ks", "probe_features"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        _check(self)

    # the grid ---------------------------------------------------------------------------

    def data_key(self) -> str:
        return digest(self.model.to_dict(), self.train_rows, self.eval_rows, self.data_seed,
                      self.rows_per_partition)  # fmt: skip

    def grid(self) -> list[tuple[str, int, int, int]]:
        """``(family, width, k, seed)`` of every SAE, in order."""
        return [(f, w, k, s) for f in self.families for w in self.widths for k in self.ks
                for s in self.seeds]  # fmt: skip

    def sae_config(self, family: str, width: int, k: int, seed: int, dataset: str = ""):
        """The ``SAEConfig`` of one point of the grid (``out_dir`` set by the sweep)."""
        from ..sae.config import SAEConfig

        values = {"batch_size": self.batch_size, "tokens": self.tokens, "progress": self.progress,
                  "plots": False, "val_dataset": "", **self.sae, "dataset": dataset,
                  "n_latents": width, "k": k, "architecture": family,
                  "seed": seed}  # fmt: skip
        return SAEConfig.from_dict(values)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["model"] = self.model.to_dict()
        return out

    @classmethod
    def load(cls, path: str | os.PathLike | None = None, **overrides) -> SweepConfig:
        """From a TOML file (module docstring) and keyword overrides; unknown keys are
        errors naming the known ones."""
        values: dict = {}
        if path is not None:
            from ..sae.config import read_toml

            data = read_toml(path)
            values = {**data.get("sweep", {}), **{k: v for k, v in data.items() if k != "sweep"}}
        values.update(overrides)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise InvalidArgumentError(
                f"unknown sweep setting(s) {unknown}; known: {sorted(known)}"
            )
        if isinstance(values.get("model"), dict):
            values["model"] = SyntheticModelConfig.from_dict(values["model"])
        return cls(**values)


def _check(c: SweepConfig) -> None:
    """Every mistake of a sweep's configuration, found before anything runs."""
    problems = []
    unknown = sorted(set(c.families) - set(FAMILIES))
    if unknown or not c.families:
        problems.append(f"families {list(c.families)}: choose among {list(FAMILIES)}")
    for name in ("widths", "ks", "seeds", "families"):
        values = getattr(c, name)
        if not values or len(set(values)) != len(values):
            problems.append(f"{name} must be a non-empty list without repeats, got {list(values)}")
    if any(w < 1 for w in c.widths) or any(k < 1 for k in c.ks):
        problems.append("widths and ks must be >= 1")
    elif c.ks and c.widths and max(c.ks) > min(c.widths):
        problems.append(f"k {max(c.ks)} exceeds the width {min(c.widths)}")
    if c.train_threads < 0:
        problems.append("train_threads must be >= 0 (0: torch's default)")
    if min(c.train_rows, c.eval_rows, c.batch_size, c.eval_batch, c.rows_per_partition) < 1:
        problems.append(
            "train_rows, eval_rows, batch_size, eval_batch, rows_per_partition must be >= 1"
        )
    if c.probe_train_rows < 1 or c.probe_test_rows < 1:
        problems.append("probe_train_rows and probe_test_rows must be >= 1")
    elif c.probe_train_rows + c.probe_test_rows > c.eval_rows:
        problems.append(f"probe_train_rows + probe_test_rows ({c.probe_train_rows + c.probe_test_rows}) "
                        f"exceed eval_rows ({c.eval_rows})")  # fmt: skip
    if not c.probe_ks or min(c.probe_ks) < 1 or (c.widths and max(c.probe_ks) > min(c.widths)):
        problems.append(f"probe_ks {list(c.probe_ks)} must be >= 1 and at most the smallest width")
    if c.probe_ks and max(c.probe_ks) > c.model.hidden_dim:
        problems.append(f"probe_ks {list(c.probe_ks)}: the raw baseline has only "
                        f"{c.model.hidden_dim} dimensions")  # fmt: skip
    if c.probe_tasks < 1 and not c.probe_features:
        problems.append("probe_tasks must be >= 1")
    if any(not 0 <= f < c.model.num_features for f in c.probe_features):
        problems.append(f"probe_features must lie in [0, {c.model.num_features})")
    taken = sorted(set(c.sae) & set(GRID_FIELDS))
    if taken:
        problems.append(f"[sae] may not set {taken}: the grid sets them")
    if problems:
        raise InvalidArgumentError("sweep config: " + "; ".join(problems))
    for point in c.grid():  # the trainer's own checks of every point, with the [sae] table
        c.sae_config(*point)


def digest(*parts) -> str:
    """Short content hash of JSON-able parts."""
    body = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(body.encode()).hexdigest()[:12]


# -- data and training ------------------------------------------------------------------


def _stage(path: Path, build: Callable[[Path], None], *, force: bool, log) -> bool:
    """``path`` built by ``build(tmp)`` under a staging name and published whole, unless it
    exists (and not ``force``); returns whether it was reused."""
    if path.is_dir() and not force:
        log(f"      reusing {path}")
        return True
    with publishing(path) as tmp:
        build(tmp)
    return False


def make_data(spark, config: SweepConfig, *, force: bool = False, log=print) -> dict[str, str]:
    """The stage ``data-{hash}``: the synthetic model and its train and eval sets."""
    from .job import synthetic_datasets

    out = Path(config.out) / f"data-{config.data_key()}"
    _stage(out, lambda tmp: synthetic_datasets(
        spark, config.model, tmp, train_rows=config.train_rows, eval_rows=config.eval_rows,
        seed=config.data_seed, rows_per_partition=config.rows_per_partition,
    ), force=force, log=log)  # fmt: skip
    return {name: str(out / name) for name in ("model", "train", "eval")}


@dataclass(frozen=True)
class TrainedSAE:
    """One SAE of the grid: where it lives and what made it."""

    name: str
    family: str
    width: int
    k: int
    seed: int
    key: str
    path: str
    reused: bool
    train_seconds: float


def train_saes(config: SweepConfig, data: dict[str, str], *, force: bool = False,
               log=print) -> list[TrainedSAE]:  # fmt: skip
    """Every SAE of the grid, trained one after another in this process (reused where its
    directory exists)."""
    import torch

    threads = torch.get_num_threads()
    if config.train_threads:
        torch.set_num_threads(config.train_threads)
    try:
        return _train_all(config, data, force=force, log=log)
    finally:
        torch.set_num_threads(threads)


def _train_all(config: SweepConfig, data: dict[str, str], *, force: bool, log):
    from ..sae.train import Trainer

    out, data_key, trained = Path(config.out) / "saes", config.data_key(), []
    points = config.grid()
    bar = _bar(len(points), "SAEs", enabled=config.progress)
    for family, width, k, seed in points:
        sae_config = config.sae_config(family, width, k, seed, data["train"])
        key = digest(data_key, replace(sae_config, dataset="").config_hash())
        name = f"{family}-w{width}-k{k}-s{seed}"
        path = out / f"{name}-{key}"
        started = time.perf_counter()
        if bar is not None:
            bar.set_postfix_str(name)
        reused = _stage(path, lambda tmp, c=sae_config: Trainer(replace(c, out_dir=str(tmp))).fit(),
                        force=force, log=log)  # fmt: skip
        trained.append(TrainedSAE(name, family, width, k, seed, key,
                                  str(path / "sae.safetensors"), reused,
                                  0.0 if reused else time.perf_counter() - started))  # fmt: skip
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return trained


def _bar(total: int, desc: str, *, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="SAE", dynamic_ncols=True)


# -- evaluation -------------------------------------------------------------------------


@dataclass(frozen=True)
class EvalSpec:
    """What each evaluation task needs: the model, the evaluation set, the SAE files and
    the probe tasks (small: indices and labels)."""

    model: str
    eval_dataset: str
    sae_paths: tuple[str, ...]
    eval_rows: int
    batch: int
    probe_rows: int
    tasks: tuple = ()
    probe_ks: tuple[int, ...] = (1, 2, 5)
    threads: int = 0
    """torch threads of a task (0: torch's default)."""


def probe_setup(config: SweepConfig, data: dict[str, str]):
    """``(tasks, pool_x)``: the probe tasks over the first rows of the evaluation set,
    chosen from their true activations, and those rows' activations."""
    import torch

    from .groundtruth import dense_truth, ground_truth_batches
    from .probing import synthetic_probe_tasks

    rows = config.probe_train_rows + config.probe_test_rows
    xs, active = [], []
    for x, idx, vals in ground_truth_batches(data["eval"], rows=rows, batch=config.eval_batch):
        xs.append(x)
        active.append((dense_truth(idx, vals, config.model.num_features) > 0).numpy())
    tasks = synthetic_probe_tasks(
        np.concatenate(active), train_rows=config.probe_train_rows, n_tasks=config.probe_tasks,
        min_positives=config.probe_min_positives, seed=config.data_seed,
        features=config.probe_features,
    )  # fmt: skip
    return tuple(tasks), torch.cat(xs)


def prepare_evaluation(config: SweepConfig, data: dict[str, str],
                       sae_paths: Sequence[str]) -> tuple[EvalSpec, dict]:  # fmt: skip
    """``(spec, baseline)``: what each evaluation task runs on the SAE files ``sae_paths``
    (one torch thread: a task per core) and the probes on the raw activations."""
    from .probing import probe_tasks

    tasks, pool_x = probe_setup(config, data)
    baseline = probe_tasks(pool_x, tasks, ks=config.probe_ks)
    spec = EvalSpec(data["model"], data["eval"], tuple(sae_paths), config.eval_rows,
                    config.eval_batch, len(pool_x), tasks, config.probe_ks, threads=1)  # fmt: skip
    return spec, baseline


def evaluate_sae(spec: EvalSpec, i: int) -> dict:
    """The figures of SAE ``i`` of ``spec``: ``evaluate_ground_truth`` over the evaluation
    rows and the sparse probes on the first ``probe_rows`` of them (read in the same pass),
    on ``spec.threads`` torch threads."""
    import torch

    threads = torch.get_num_threads()
    if spec.threads:
        torch.set_num_threads(spec.threads)
    try:
        return _evaluate(spec, i)
    finally:
        torch.set_num_threads(threads)


def _evaluate(spec: EvalSpec, i: int) -> dict:
    import torch

    from ..sae import load_sae_model
    from .core import CoreSums
    from .groundtruth import evaluate_ground_truth, ground_truth_batches
    from .job import _model
    from .probing import dense_codes, probe_tasks

    started = time.perf_counter()
    model = _model(spec.model)
    sae = load_sae_model(spec.sae_paths[i], device="cpu")
    pool: list = []
    core = CoreSums(sae.latents_total)
    metrics = evaluate_ground_truth(
        sae, model.feature_vectors,
        _keeping(ground_truth_batches(spec.eval_dataset, rows=spec.eval_rows, batch=spec.batch),
                 spec.probe_rows, pool),
        parent_of=model.parent_of, core=core,
    )  # fmt: skip
    probes = probe_tasks(dense_codes(sae, torch.cat(pool), spec.batch), spec.tasks,
                         ks=spec.probe_ks)  # fmt: skip
    return {"index": i, **metrics.to_dict(), "fvu": 1 - metrics.explained_variance,
            "probe": probes, "core": core.result(sae).to_dict(),
            "eval_seconds": time.perf_counter() - started}  # fmt: skip


def _keeping(batches, rows: int, kept: list):
    """The batches, passed on, the ``x`` of their first ``rows`` rows appended to ``kept``."""
    have = 0
    for x, idx, vals in batches:
        if have < rows:
            kept.append(x[: rows - have])
            have += len(kept[-1])
        yield x, idx, vals


def evaluate_in_loop(spec: EvalSpec) -> list[dict]:
    """Every SAE of ``spec`` in this process, one after another."""
    return [evaluate_sae(spec, i) for i in range(len(spec.sae_paths))]


def evaluate_in_spark(spark, spec: EvalSpec, *, progress: bool = False) -> list[dict]:
    """Every SAE of ``spec`` in one Spark job, one task per SAE; results in SAE order."""
    n = len(spec.sae_paths)

    def run(batches):
        import pyarrow as pa

        for batch in batches:
            for i in batch.column("id").to_pylist():
                result = json.dumps(evaluate_sae(spec, i))
                yield pa.RecordBatch.from_pydict({"index": [i], "result": [result]})

    job = spark.range(0, n, 1, n).mapInArrow(run, "index long, result string")
    # Spark's own console bar, when on, already counts the tasks
    console = spark.sparkContext.getConf().get("spark.ui.showConsoleProgress", "false")
    with _job_progress(spark, n, enabled=progress and console != "true"):
        rows = job.collect()
    results = sorted((json.loads(r["result"]) for r in rows), key=lambda r: r["index"])
    assert [r["index"] for r in results] == list(range(n))
    return results


class _job_progress:
    """A progress bar of the tasks Spark has finished, polled from its status tracker."""

    def __init__(self, spark, total: int, *, enabled: bool):
        self.spark, self.total, self.enabled = spark, total, enabled
        self.done = threading.Event()

    def __enter__(self):
        if self.enabled:
            self.bar = _bar(self.total, "evaluation (Spark tasks)", enabled=True)
            self.thread = threading.Thread(target=self._poll, daemon=True)
            self.thread.start()
        return self

    def _poll(self):
        tracker = self.spark.sparkContext.statusTracker()
        while not self.done.wait(0.5):
            finished = 0
            for stage in tracker.getActiveStageIds():
                info = tracker.getStageInfo(stage)
                finished = max(finished, info.numCompletedTasks if info else 0)
            self.bar.update(max(0, finished - self.bar.n))

    def __exit__(self, *exc):
        if self.enabled:
            self.done.set()
            self.thread.join()
            if exc[0] is None:
                self.bar.update(self.total - self.bar.n)
            self.bar.close()


# -- the sweep --------------------------------------------------------------------------


def run_sweep(spark, config: SweepConfig, *, force: bool = False, log=print) -> dict:
    """Data, SAEs, their evaluation in one Spark job, results and report (module
    docstring); returns ``{data, saes, evaluation, report, results, reused}``."""
    started = time.perf_counter()
    out = Path(config.out)
    log(f"[1/4] synthetic data ({config.model.num_features} features in "
        f"{config.model.hidden_dim} dimensions)")  # fmt: skip
    data = make_data(spark, config, force=force, log=log)
    log(f"[2/4] training {len(config.grid())} SAEs")
    saes = train_saes(config, data, force=force, log=log)
    key = digest(config.data_key(), [s.key for s in saes], config.eval_batch,
                 config.probe_train_rows, config.probe_test_rows, config.probe_tasks,
                 config.probe_features, config.probe_ks, config.probe_min_positives)  # fmt: skip
    path = out / f"eval-{key}"
    log(f"[3/4] evaluating {len(saes)} SAEs in one Spark job (a task per SAE)")

    def build(tmp: Path) -> None:
        spec, baseline = prepare_evaluation(config, data, [s.path for s in saes])
        t0 = time.perf_counter()
        results = evaluate_in_spark(spark, spec, progress=config.progress)
        seconds = time.perf_counter() - t0
        log("[4/4] results and report")
        write_results(tmp, config, saes, results, baseline, spec.tasks, seconds)

    reused = _stage(path, build, force=force, log=log)
    _link(out / "eval", path.name)
    log(f"report: {path / 'report.md'} ({time.perf_counter() - started:.0f} s)")
    return {"data": data, "saes": [s.path for s in saes], "evaluation": str(path),
            "report": str(path / "report.md"), "results": str(path / "results.parquet"),
            "reused": {"saes": sum(s.reused for s in saes), "evaluation": reused}}  # fmt: skip


def _link(link: Path, target: str) -> None:
    """``link`` pointing at ``target`` (a sibling), replaced atomically."""
    tmp = link.with_name(f".{link.name}.link")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target, target_is_directory=True)
    os.replace(tmp, link)


# -- results and report -----------------------------------------------------------------


def result_rows(saes: Sequence[TrainedSAE], results: Sequence[dict]) -> list[dict]:
    """One flat row per SAE: what made it and its figures (probe accuracies as
    ``probe_top_{k}`` and ``probe_full``, the means over the tasks; SAEBench's core
    figures, ``CORE_FIGURES``, under their names)."""
    rows = []
    for sae, r in zip(saes, results, strict=True):
        row = {"name": sae.name, "family": sae.family, "width": sae.width, "k": sae.k,
               "seed": sae.seed, "key": sae.key, "path": sae.path,
               "train_seconds": sae.train_seconds}  # fmt: skip
        row.update({k: v for k, v in r.items()
                    if k not in ("index", "probe", "core", "per_parent_absorption")})  # fmt: skip
        row.update({f"probe_{k}": v for k, v in r["probe"].items() if k != "tasks"})
        row.update({k: r["core"][k] for k, _, _ in CORE_FIGURES})
        rows.append(row)
    return rows


def write_results(out: Path, config: SweepConfig, saes: Sequence[TrainedSAE],
                  results: Sequence[dict], baseline: dict, tasks, seconds: float) -> None:  # fmt: skip
    """``results.parquet``, ``results.json``, the plots and ``report.md`` into ``out``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = result_rows(saes, results)
    pq.write_table(pa.Table.from_pylist(rows), out / "results.parquet")
    tasks_info = [{"name": t.name, "train_examples": len(t.train_labels),
                   "test_examples": len(t.test_labels)} for t in tasks]  # fmt: skip
    doc = {"config": config.to_dict(), "evaluation_seconds": seconds, "baseline": baseline,
           "probe_tasks": tasks_info,
           "saes": [{**row, "probe": r["probe"], "per_parent_absorption": r["per_parent_absorption"]}
                    for row, r in zip(rows, results, strict=True)]}  # fmt: skip
    (out / "results.json").write_text(json.dumps(doc, indent=1) + "\n")
    plots = plot_pareto(rows, out, probe_key=f"probe_top_{config.probe_ks[0]}")
    (out / "report.md").write_text(render_report(config, rows, baseline, tasks_info, plots,
                                                 seconds))  # fmt: skip


def core_table(rows: Sequence[dict]) -> list[str]:
    """SAEBench's core figures of each (family, width, k), mean ± sd over its seeds, in
    the leaderboard's order."""
    header = ["family", "width", "k", *(h for _, h, _ in CORE_FIGURES)]
    groups = sorted(_groups(rows).items(), key=lambda kv: -_spread([r["mcc"] for r in kv[1]])[0])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for (family, width, k), members in groups:
        cells = [family, str(width), str(k)]
        cells += [_cell([r[key] for r in members], spec) for key, _, spec in CORE_FIGURES]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _groups(rows: Sequence[dict]) -> dict[tuple, list[dict]]:
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["family"], row["width"], row["k"]), []).append(row)
    return groups


def _spread(values: Sequence) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value) of the finite values."""
    v = np.array([x for x in values if x is not None and math.isfinite(x)], dtype=float)
    if v.size == 0:
        return math.nan, math.nan
    return float(v.mean()), float(v.std(ddof=1)) if v.size > 1 else 0.0


def _cell(values: Sequence, spec: str = ".3f") -> str:
    mean, sd = _spread(values)
    if math.isnan(mean):
        return "—"
    return f"{mean:{spec}}" if len(values) < 2 else f"{mean:{spec}} ± {sd:{spec}}"


def _probe_keys(rows: Sequence[dict]) -> list[str]:
    return [k for k in rows[0] if k.startswith("probe_")] if rows else []


def _probe_heading(key: str) -> str:
    """``probe_top_1`` -> ``probe top-1``."""
    return key.replace("probe_", "probe ").replace("_", "-")


def leaderboard(rows: Sequence[dict]) -> list[str]:
    """The markdown leaderboard: a line per (family, width, k), mean ± sd over its seeds,
    best MCC first."""
    probes = _probe_keys(rows)
    header = ["family", "width", "k", "seeds", *(h for _, h, _ in FIGURES),
              *(_probe_heading(p) for p in probes)]  # fmt: skip
    groups = sorted(_groups(rows).items(), key=lambda kv: -_spread([r["mcc"] for r in kv[1]])[0])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for (family, width, k), members in groups:
        cells = [family, str(width), str(k), str(len(members))]
        for key, _, _ in FIGURES:
            spec = {"sae_l0": ".1f", "dead_latents": ".1f", "absorption": ".4f"}.get(key, ".3f")
            cells.append(_cell([r[key] for r in members], spec))
        cells += [_cell([r[p] for r in members]) for p in probes]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


PLOTTED = (("mcc", "MCC", True), ("f1", "F1", True), ("fvu", "FVU", False),
           ("absorption", "absorption", False))  # fmt: skip


def plot_pareto(rows: Sequence[dict], out: Path, *, probe_key: str = "") -> dict[str, str]:
    """``pareto-{metric}.png`` per metric: L0 against it, a point per (family, width, k)
    with its spread over seeds as error bars, and the frontier over every SAE; returns
    ``{metric: file name}``."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never open a window
    import matplotlib.pyplot as plt

    plotted = [*PLOTTED, *([(probe_key, f"probe accuracy ({probe_key[6:].replace('_', '-')})",
                             True)] if probe_key else [])]  # fmt: skip
    written, groups = {}, _groups(rows)
    families = list(dict.fromkeys(r["family"] for r in rows))
    widths = sorted({r["width"] for r in rows})
    markers = dict(zip(widths, "osD^v<>p*h", strict=False))
    for key, label, higher in plotted:
        fig, ax = plt.subplots(figsize=(6, 4.2))
        for (family, width, k), members in groups.items():
            x, xs = _spread([r["sae_l0"] for r in members])
            y, ys = _spread([r[key] for r in members])
            if math.isnan(y):
                continue
            color = f"C{families.index(family)}"
            ax.errorbar(x, y, xerr=xs, yerr=ys, fmt=markers.get(width, "o"), color=color,
                        markersize=6, capsize=3, alpha=0.85)  # fmt: skip
            ax.annotate(f"k{k}", (x, y), textcoords="offset points", xytext=(5, 3), fontsize=7)
        front = _frontier([(r["sae_l0"], r[key]) for r in rows], higher)
        if len(front) > 1:
            ax.plot(*zip(*front, strict=True), "--", color="grey", linewidth=1,
                    drawstyle="steps-post", label="frontier (every SAE)")  # fmt: skip
        for i, family in enumerate(families):
            ax.plot([], [], "o", color=f"C{i}", label=family)
        for width in widths:
            ax.plot([], [], markers.get(width, "o"), color="black", fillstyle="none",
                    label=f"width {width}")  # fmt: skip
        ax.set_xlabel("L0 (active latents per row, evaluation set)")
        ax.set_ylabel(label + (" (higher is better)" if higher else " (lower is better)"))
        ax.set_title(f"L0 against {label}: mean ± sd over seeds", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, frameon=False, loc="best")
        fig.tight_layout()
        name = f"pareto-{key.replace('_', '-')}.png"
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written[label] = name
    return written


def _frontier(points: Sequence[tuple[float, float]], higher: bool) -> list[tuple[float, float]]:
    """The points no other beats at a lower or equal L0 (x) on the figure (y)."""
    best, front = None, []
    for x, y in sorted((p for p in points if p[1] is not None and math.isfinite(p[1])),
                       key=lambda p: (p[0], -p[1] if higher else p[1])):  # fmt: skip
        if best is None or (y > best if higher else y < best):
            best = y
            front.append((x, y))
    return front


def render_report(config: SweepConfig, rows: Sequence[dict], baseline: dict,
                  tasks: Sequence[dict], plots: dict[str, str], seconds: float) -> str:  # fmt: skip
    """The sweep's ``report.md``."""
    m = config.model
    h = m.hierarchy
    shape = (f"{m.num_features} true features in {m.hidden_dim} dimensions"
             + (f", a hierarchy of {h.total_root_nodes} trees (branching {h.branching_factor}, "
                f"depth {h.max_depth})" if h else ""))  # fmt: skip
    true_l0 = rows[0]["true_l0"] if rows else math.nan
    probes = _probe_keys(rows)
    lines = [
        "# SAE sweep on a synthetic model", "",
        f"Synthetic model: {shape}; true L0 {true_l0:.2f} on the evaluation set. "
        f"{config.train_rows:,} training rows, {config.eval_rows:,} evaluation rows (other "
        f"draws). {len(rows)} SAEs: families {', '.join(config.families)} x widths "
        f"{', '.join(map(str, config.widths))} x k {', '.join(map(str, config.ks))} x seeds "
        f"{', '.join(map(str, config.seeds))}; evaluated in one Spark job, a task per SAE, "
        f"in {seconds:.1f} s.", "",
        "## Leaderboard", "",
        "Mean ± sd over the seeds of each (family, width, k), best MCC first. FVU = 1 - "
        "explained variance; dead: latents that never fire on the evaluation rows; "
        "absorption on the hierarchy (docs/evaluation.md); probe: SAEBench's sparse probing, "
        f"the mean test accuracy over {len(tasks)} tasks \"does true feature f fire\".", "",
        *leaderboard(rows), "",
        "Probes on the raw activations (SAEBench's baseline): "
        + ", ".join(f"{p.replace('probe_', '').replace('_', '-')} {baseline[p[6:]]:.3f}"
                    for p in probes if p[6:] in baseline) + ".", "",
        "## SAEBench's core figures", "",
        "Mean ± sd over the seeds (evaluation/core.py): cos sim, the mean cosine of a row "
        "and its reconstruction; L2 ratio, the mean |x_hat| / |x|; rel. bias, E|x_hat|^2 / "
        "E<x, x_hat> (1: no shrinkage); L1, the mean sum of the code; alive, the share of "
        "latents that fire; > 1 %, the share firing on more than 1 % of the rows; max enc. / "
        "dec. cos, the mean over the latents of the cosine to the closest other latent's "
        "encoder / decoder row (high: duplicates).", "",
        *core_table(rows), "",
        "## Pareto plots", "",
        *(f"![L0 against {label}]({name})" for label, name in plots.items()), "",
        "## Every SAE", "",
        "| SAE | L0 | MCC | F1 | FVU | dead | absorption | "
        + " | ".join(_probe_heading(p) for p in probes) + " | trained (s; 0: reused) |",
        "|" + "---|" * (8 + len(probes)),
    ]  # fmt: skip
    for r in rows:
        absorption = "—" if r["absorption"] is None else f"{r['absorption']:.4f}"
        lines.append(f"| {r['name']} | {r['sae_l0']:.1f} | {r['mcc']:.3f} | {r['f1']:.3f} | "
                     f"{r['fvu']:.3f} | {r['dead_latents']} | {absorption} | "
                     + " | ".join(f"{r[p]:.3f}" for p in probes)
                     + f" | {r['train_seconds']:.0f} |")  # fmt: skip
    lines += ["", "## Probe tasks", "",
              ", ".join(f"{t['name']} ({t['train_examples']} / {t['test_examples']} examples)"
                        for t in tasks) + " (training / test, balanced).", ""]  # fmt: skip
    return "\n".join(lines)
