"""The streaming sink against the batch writer on the same micro-batches
(``python -m benchmarks stream``, by name only).

The input: ``FILES`` parquet files of ``rows`` rows (each size of ``SIZES``), each an
``id`` and a ``list<float>`` of ``H`` values. The sink reads them as a file stream, one
file per micro-batch (``maxFilesPerTrigger=1``, ``availableNow``): a micro-batch per file,
each one append with its batch id in the manifest. The batch writer appends the same
files one by one (one job and one commit per file, as a driver loop would), and, for
reference, writes them all in one job. Python source on both sides (and, the shim jar
built, the JVM source's sink against its own appends), ``local[2]``, batch mode,
``batch_size`` 8,192, F32; rows/s of the whole run, best of ``REPEAT``, each into a
fresh directory. And the same stream into ``foreachBatch``, each micro-batch appended with
the batch writer: the glue the sink replaces (no exactly-once). The sink's query progress
splits a micro-batch's time into the write (``addBatch``: its Spark job and the sink's
commit) and Spark's own bookkeeping around it (offset and commit logs in the checkpoint,
the file source's listing, planning). The session is ``local_session``'s, whose
checkpoint logs go through Hadoop's FileSystem API (``spark.session.checkpoint_manager``);
the sink is timed once more under Spark's default manager, which forks a ``chmod`` per
log file on a JVM without Hadoop's native library.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from benchmarks.common import table
from pyspark_safetensors.spark.session import CHECKPOINT_MANAGER

FILES, H = 16, 256
SIZES = (32_768, 131_072)
"""Rows per micro-batch (34 MB and 134 MB of float32)."""
REPEAT = 3


def _inputs(root: Path, rows: int) -> list[str]:
    rng = np.random.default_rng(0)
    paths = []
    for f in range(FILES):
        values = rng.standard_normal((rows, H), dtype=np.float32)
        x = pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), H).cast(
            pa.list_(pa.float32())
        )
        ids = pa.array(np.arange(f * rows, (f + 1) * rows))
        path = root / "in" / f"{f:03d}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"id": ids, "x": x}), path)
        paths.append(str(path))
    return paths


def _timed(runs: list[tuple[str, object]], out: Path) -> list[tuple[str, float]]:
    """Each run's best seconds of ``REPEAT``, taken in rounds of every run (the JVM's and
    the workers' warm-up, and the load's drift, shared alike), each into a fresh ``out``."""
    best = {name: float("inf") for name, _ in runs}
    for _ in range(REPEAT):
        for name, fn in runs:
            shutil.rmtree(out, ignore_errors=True)
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return list(best.items())


def _has_shim() -> bool:
    from pyspark_safetensors.spark.shim import shim_jar

    try:
        shim_jar()
    except FileNotFoundError:
        return False
    return True


def _measure(spark, root: Path, rows: int) -> tuple[list[tuple[str, float]], float, float]:
    """(each write's best seconds, the sink's mean addBatch and other trigger ms)."""
    from pyspark_safetensors.dataset import load_manifest

    paths = _inputs(root, rows)
    schema = spark.read.parquet(paths[0]).schema
    out = root / "out"
    options = {"implementation": "python", "batch_size": "8192"}
    jvm = {**options, "implementation": "jvm"}
    progress: list[dict] = []

    def sink_default_checkpoint():
        manager = spark.conf.get(CHECKPOINT_MANAGER)
        spark.conf.unset(CHECKPOINT_MANAGER)
        try:
            sink(keep_progress=False)
        finally:
            spark.conf.set(CHECKPOINT_MANAGER, manager)

    def sink(keep_progress=True, options=options):
        shutil.rmtree(root / "ck", ignore_errors=True)
        stream = spark.readStream.schema(schema).option("maxFilesPerTrigger", 1)
        writer = stream.parquet(str(root / "in")).writeStream.format("safetensors")
        query = (
            writer.options(**options)
            .option("checkpointLocation", str(root / "ck"))
            .trigger(availableNow=True)
            .start(str(out))
        )
        query.awaitTermination()
        if keep_progress:
            progress[:] = [p["durationMs"] for p in query.recentProgress]
        assert load_manifest(out).total_samples == FILES * rows

    def for_each_batch():
        shutil.rmtree(root / "ck", ignore_errors=True)

        def append(df, _batch_id):
            df.write.format("safetensors").options(**options).mode("append").save(str(out))

        stream = spark.readStream.schema(schema).option("maxFilesPerTrigger", 1)
        query = (
            stream.parquet(str(root / "in"))
            .writeStream.foreachBatch(append)
            .option("checkpointLocation", str(root / "ck"))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination()

    def appends(options=options):
        for path in paths:
            df = spark.read.parquet(path)
            df.write.format("safetensors").options(**options).mode("append").save(str(out))

    def one_job():
        df = spark.read.parquet(*paths)
        df.write.format("safetensors").options(**options).mode("overwrite").save(str(out))

    runs = [
        ("streaming sink, a micro-batch per file", sink),
        ("batch writer, an append per file", appends),
        ("batch writer, one job", one_job),
        ("foreachBatch, the batch writer's append per micro-batch", for_each_batch),
        ("streaming sink, Spark's default checkpoint manager", sink_default_checkpoint),
    ]
    if _has_shim():
        runs += [
            ("JVM source: streaming sink", partial(sink, keep_progress=False, options=jvm)),
            ("JVM source: batch writer, an append per file", partial(appends, options=jvm)),
        ]
    measured = _timed(runs, out)
    write = np.mean([p["addBatch"] for p in progress])
    spark_ms = np.mean([p["triggerExecution"] - p["addBatch"] for p in progress])
    shutil.rmtree(root / "in")
    return measured, float(write), float(spark_ms)


def run() -> str:
    from pyspark_safetensors.spark.session import local_session

    load0 = os.getloadavg()[0]
    spark = local_session("local[2]", **{"spark.ui.enabled": "false"})
    root = Path(tempfile.mkdtemp(prefix="bench-stream-"))
    rows_out, notes = [], []
    try:
        for rows in SIZES:
            measured, write_ms, spark_ms = _measure(spark, root, rows)
            seconds = dict(measured)
            base = seconds["batch writer, an append per file"]
            jvm_base = seconds.get("JVM source: batch writer, an append per file")
            mb = rows * H * 4 / 1e6
            for name, s in measured:
                to = jvm_base if name.startswith("JVM") else base  # each source's appends
                rows_out.append([f"{rows:,} rows ({mb:.0f} MB)", name, f"{s:.2f}",
                                 f"{FILES * rows / s:,.0f}", f"{FILES * mb / s:.0f}",
                                 f"{to / s:.2f}x"])  # fmt: skip
            sink = seconds["streaming sink, a micro-batch per file"]
            each = seconds["foreachBatch, the batch writer's append per micro-batch"]
            jvm = (
                f", the JVM source's sink {jvm_base / seconds['JVM source: streaming sink']:.2f}x"
                " its appends'"
                if jvm_base
                else ""
            )
            notes.append(
                f"{rows:,} rows: the sink's rows/s {base / sink:.2f}x the batch writer's "
                f"appends, {each / sink:.2f}x foreachBatch's appends of the same stream{jvm}; "
                f"a micro-batch {(sink - base) / FILES:+.2f} s against an append, of which "
                f"the write (addBatch) {write_ms / 1e3:.2f} s and Spark's bookkeeping around "
                f"it {spark_ms / 1e3:.2f} s"
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    body = table(["micro-batch", "write", "seconds", "rows/s", "MB/s", "rows/s vs appends"],
                 rows_out)  # fmt: skip
    return (
        f"## Streaming sink (python -m benchmarks stream)\n\n{FILES} micro-batches of {H} "
        f"float32 per row, parquet files in; best of {REPEAT}.\n\n{body}\n\n"
        + ";\n".join(notes)
        + ". The bookkeeping (the offset and commit logs in the checkpoint, the file "
        "source's listing, planning) is Spark's, the same for any sink; one job writes the "
        "same rows in one plan and one commit. Checkpoint logs through Hadoop's FileSystem "
        "API (local_session's), but in the rows \"Spark's default checkpoint manager\": "
        f"the FileContext API. Load average {load0:.2f} before, "
        f"{os.getloadavg()[0]:.2f} after, on {os.cpu_count()} cores."
    )
