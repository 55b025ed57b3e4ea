"""Spark reader throughput: the writer benchmark's 200,000 x 256 float32 dataset read back
into ``count()`` and ``toArrow()``, against Spark's parquet reader on the same data."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from benchmarks.bench_writer import DIM, ROWS, make_df
from benchmarks.common import median_seconds, table

REPEAT = 5


def run() -> str:
    from pyspark_safetensors.spark.session import local_session

    spark = local_session("local[2]", **{"spark.ui.showConsoleProgress": "false"})
    acts = make_df(spark).select("activation")
    out = Path(tempfile.mkdtemp(prefix="bench-reader-"))
    acts.write.mode("overwrite").parquet(str(out / "pq"))
    acts.write.format("safetensors").option("batch_size", 10_000).mode("overwrite").save(
        str(out / "st")
    )
    mb = ROWS * DIM * 4 / 1e6

    def parquet():
        return spark.read.parquet(str(out / "pq"))

    def ours():
        return spark.read.format("safetensors").load(str(out / "st"))

    cases = [
        ("count()", "parquet", lambda: parquet().count()),
        ("count()", "safetensors", lambda: ours().count()),
        ("toArrow()", "parquet", lambda: parquet().toArrow()),
        ("toArrow()", "safetensors", lambda: ours().toArrow()),
    ]
    seconds = {(op, name): median_seconds(fn, repeat=REPEAT, warmup=1) for op, name, fn in cases}
    rows = [
        [op, name, f"{s:.2f}", f"{mb / s:.0f}", f"{seconds[(op, 'parquet')] / s:.2f}x"]
        for (op, name), s in seconds.items()
    ]
    spark.stop()
    shutil.rmtree(out, ignore_errors=True)
    return (
        "## Spark reader: the 200,000 × 256 float32 dataset read back\n\n"
        f"Same session, local[2], warm page cache, median of {REPEAT}; MB/s of float32 data ({mb:.0f} MB). "
        "Our reader gets no column pruning from Spark (Python sources), so `count()` still "
        "builds every row's array; parquet's `count()` reads only metadata.\n\n"
        + table(["operation", "reader", "seconds", "MB/s", "vs parquet"], rows)
    )
