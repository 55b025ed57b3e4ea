"""A 12-SAE sweep's evaluation (``evaluation/sweep.py``) as one Spark job, a task per SAE,
against a plain loop over the same SAE files in one process, on the same cores and the same
evaluation rows: ground-truth figures over every row and SAEBench's sparse probes on the
first 4,000. The SAEs (4 families x 3 seeds, 512 latents, k = 8) are trained once,
untimed, by the sweep itself; the figures of both must agree."""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time

from pyspark_safetensors.evaluation.sweep import (
    SweepConfig,
    evaluate_in_loop,
    evaluate_in_spark,
    make_data,
    prepare_evaluation,
    train_saes,
)
from pyspark_safetensors.spark.session import local_session

from .common import table

REPEAT = 3


def _config(out: str) -> SweepConfig:
    return SweepConfig(out=out, train_rows=32_768, eval_rows=16_384, widths=(512,), ks=(8,),
                       seeds=(0, 1, 2), tokens=131_072, train_threads=1, progress=False,
                       sae={"checkpoints": 0})  # fmt: skip


def _timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def _largest_difference(a: list[dict], b: list[dict]) -> float:
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        for key, value in x.items():
            if isinstance(value, float) and key != "eval_seconds" and value == value:
                worst = max(worst, abs(value - y[key]))
        for task, acc in x["probe"]["tasks"].items():
            worst = max(worst, *(abs(v - y["probe"]["tasks"][task][k]) for k, v in acc.items()))
    return worst


def run() -> str:
    cores = os.cpu_count() or 1
    root = tempfile.mkdtemp(prefix="bench-sweep-")
    spark = local_session(f"local[{cores}]")
    try:
        config = _config(root)
        data = make_data(spark, config, log=lambda *_: None)
        saes = train_saes(config, data, log=lambda *_: None)
        spec, _ = prepare_evaluation(config, data, [s.path for s in saes])
        first, reference = _timed(lambda: evaluate_in_spark(spark, spec))
        spark_s, loop1_s, loop2_s = [], [], []
        for _ in range(REPEAT):  # in turn, so the machine's drift touches each alike
            spark_s.append(_timed(lambda: evaluate_in_spark(spark, spec))[0])
            loop1_s.append(_timed(lambda: evaluate_in_loop(spec))[0])  # one thread, as a task
            seconds, loop = _timed(
                lambda: evaluate_in_loop(dataclasses.replace(spec, threads=cores))
            )
            loop2_s.append(seconds)
        worst = _largest_difference(reference, loop)
    finally:
        spark.stop()
        shutil.rmtree(root, ignore_errors=True)
    n = len(spec.sae_paths)
    med = {name: sorted(t)[len(t) // 2] for name, t in
           (("spark", spark_s), ("loop1", loop1_s), ("loop2", loop2_s))}  # fmt: skip
    faster = min(med["loop1"], med["loop2"])
    rows = [
        [f"Spark `local[{cores}]`, a task per SAE (1 torch thread each)",
         f"{med['spark']:.1f}", f"{n / med['spark']:.2f}", f"{faster / med['spark']:.2f}x"],
        ["Spark, the session's first job (Python workers start, import torch)",
         f"{first:.1f}", f"{n / first:.2f}", f"{faster / first:.2f}x"],
        ["loop in one process, 1 torch thread", f"{med['loop1']:.1f}", f"{n / med['loop1']:.2f}",
         f"{faster / med['loop1']:.2f}x"],
        [f"loop in one process, {cores} torch threads", f"{med['loop2']:.1f}",
         f"{n / med['loop2']:.2f}", f"{faster / med['loop2']:.2f}x"],
    ]  # fmt: skip
    return (
        f"## Sweep: {n} SAEs evaluated in one Spark job against a loop\n\n"
        f"`python -m benchmarks sweep`. {n} SAEs ({', '.join(config.families)} x seeds "
        f"{', '.join(map(str, config.seeds))}; {', '.join(map(str, config.widths))} latents, "
        f"k = {', '.join(map(str, config.ks))}, {config.tokens // config.batch_size} steps "
        f"each) of a synthetic model of "
        f"{config.model.num_features} features in {config.model.hidden_dim} dimensions; each "
        f"SAE's evaluation: `evaluate_ground_truth` over {config.eval_rows:,} rows and "
        f"{len(spec.tasks)} sparse-probe tasks (k = {', '.join(map(str, spec.probe_ks))} and "
        "full width) on the first "
        f"{spec.probe_rows:,}, the same function in both (`evaluate_sae`). Median of "
        f"{REPEAT} runs taken in turn; the first Spark job apart. Largest difference "
        f"between the job's figures and the loop's: {worst:.1e}.\n\n"
        + table(["evaluation", "seconds", "SAEs/s", "against the faster loop"], rows)
    )
