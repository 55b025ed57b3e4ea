"""The pipeline with its extraction and training at once against one after the other
(``python -m benchmarks pipeline_overlap``, by name only: a few minutes).

The same pipeline config (the packaged MiniLM, the demo passages, one SAE per hook point,
one pass; LUT and evaluation stages as usual, features off) run through the CLI, each run
in a new output directory: ``overlap = false`` (extract, then train) and ``overlap =
true`` (the extraction commits its datasets in ``overlap_groups`` groups of texts and the
SAE training follows them from the first commit). End to end: the CLI process's wall
time, Python's start and imports included. The extraction's Spark runs one task at a time
(``local[1]``); ``THREADS`` sets its worker's torch threads. On 2 cores the overlap can
only win what one stage leaves idle.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import table

TEXTS, GROUPS, MASTER = 960, 4, "local[1]"
HOOKS = {"encoder.layer.3.intermediate.dense:input": ["encoder.layer.3.intermediate.dense"]}
SAE = {"expansion_factor": 24, "k": 32, "batch_size": 1024, "log_every": 10}
THREADS = {"model stage on every core": 0, "model stage on one thread": 1}
"""The arrangements timed, by ``extract_threads``: 0 (the extraction's worker takes every
core, overlapped or not; overlapped, the training takes what it leaves, at the lowest CPU
priority) and 1 (the extraction bound by its Spark parallelism, as where executors are
the limit: a core is left to the training)."""


def config(overlap: bool, threads: int) -> str:
    hooks = "\n".join(f'"{hook}" = {json.dumps(layers)}' for hook, layers in HOOKS.items())
    sae = "\n".join(f"{key} = {json.dumps(value)}" for key, value in SAE.items())
    return f"""[pipeline]
texts = {TEXTS}
held_out_texts = 32
max_length = 128
master = "{MASTER}"
nproc = 1
epochs = 1
ms = [0]
features = false
llama3_8b_latency = false
overlap = {str(overlap).lower()}
overlap_groups = {GROUPS}
extract_threads = {threads}
[pipeline.hooks]
{hooks}
[sae]
{sae}
follow_poll_s = 0.2
"""


def _quiet(below: float = 1.5, wait_s: float = 180) -> float:
    """The 1-minute load once under ``below`` (the previous run's tail has decayed), or
    after ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while os.getloadavg()[0] >= below and time.monotonic() < deadline:
        time.sleep(5)
    return os.getloadavg()[0]


def run_pipeline(work: Path, overlap: bool, threads: int) -> dict:
    """One pipeline run in a new output directory: its wall seconds and summary."""
    name = f"{'overlapped' if overlap else 'sequential'}-{threads}"
    (work / f"{name}.toml").write_text(config(overlap, threads))
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable}
    load = _quiet()
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "pyspark_safetensors.cli", "pipeline", "--config",
         f"{name}.toml", "--out", name],
        cwd=work, env=env, capture_output=True, text=True,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise RuntimeError(f"the {name} pipeline failed:\n{result.stderr[-3000:]}")
    summary = json.loads((work / name / "summary.json").read_text())
    return {"seconds": seconds, "summary": summary, "load": load}


def _row(arrangement: str, name: str, run: dict) -> list[object]:
    s = run["summary"]
    steps = sum(t["step"] for t in s["training"].values())
    fvu = " / ".join(f"{s['evaluation']['sae'][h]['fvu']:.3f}" for h in HOOKS)
    return [arrangement, name, f"{run['seconds']:.1f}", f"{s['seconds']:.1f}",
            f"{s['extraction']['seconds']:.1f}", steps, fvu, f"{run['load']:.2f}"]  # fmt: skip


def run() -> str:
    work = Path(tempfile.mkdtemp(prefix="bench-pipeline-overlap-"))
    rows, ratios = [], []
    try:
        for arrangement, threads in THREADS.items():
            sequential = run_pipeline(work, False, threads)
            overlapped = run_pipeline(work, True, threads)
            rows += [_row(arrangement, "one after the other", sequential),
                     _row(arrangement, "overlapped", overlapped)]  # fmt: skip
            ratio = sequential["seconds"] / overlapped["seconds"]
            ratios.append(f"{ratio:.2f}x with the {arrangement}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    tokens = sequential["summary"]["extraction"]["tokens"]
    header = ["arrangement", "stages", "wall s", "pipeline s", "model stage s", "SAE steps",
              "held-out FVU", "load before"]  # fmt: skip
    return "\n\n".join(
        [
            "## The pipeline overlapping its stages (python -m benchmarks pipeline_overlap)",
            f"{TEXTS} demo passages ({tokens:,} tokens) through MiniLM in Spark ({MASTER}), "
            f"{len(HOOKS)} hook point(s), an SAE each ({SAE['expansion_factor']}x, k "
            f"{SAE['k']}, batch {SAE['batch_size']:,}, every token once) trained in the "
            "pipeline's process (nproc 1), then the LUT and evaluation stages; overlapped: "
            f"{GROUPS} commits per dataset. Wall: the CLI process; pipeline: its own clock; "
            "model stage: the extraction's Spark jobs (summed over its groups).",
            table(header, rows),
            f"Overlapped: {'; '.join(ratios)}: the speed of one after the other, end to end.",
        ]
    )
