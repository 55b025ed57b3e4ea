"""Spark writer throughput: our batch and KV modes against Spark's parquet writer.

One session (local[2]), a cached DataFrame of 200,000 rows x 256 float32 in 2 partitions,
warm, median of several runs. Throughput is input float32 bytes per second.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

from benchmarks.common import interleaved_medians, table

ROWS, DIM, PARTS, REPEAT = 200_000, 256, 2, 9


def make_df(spark):
    from pyspark.sql import functions as F

    df = spark.range(ROWS, numPartitions=PARTS).select(
        F.col("id").cast("string").alias("key"),
        F.transform(
            F.array_repeat(F.lit(0.0), DIM), lambda x, i: (F.rand(42) + i).cast("float")
        ).alias("activation"),
    )
    df = df.cache()
    df.count()
    return df


def _discarding_source():
    """A Python data source whose tasks read every Arrow batch and write nothing: the
    floor of any Python writer. (Defined in a function so that workers get it by value.)"""
    from pyspark.sql.datasource import DataSource, DataSourceArrowWriter, WriterCommitMessage

    class Discard(DataSourceArrowWriter):
        def write(self, iterator):
            for _ in iterator:
                pass
            return WriterCommitMessage()

    class DiscardSource(DataSource):
        @classmethod
        def name(cls):
            return "discard"

        def writer(self, schema, overwrite):
            return Discard()

    return DiscardSource


def run() -> str:
    from pyspark_safetensors.spark.session import local_session

    spark = local_session("local[2]", **{"spark.ui.showConsoleProgress": "false"})
    df = make_df(spark)
    acts = df.select("activation")
    mb = ROWS * DIM * 4 / 1e6
    out = Path(tempfile.mkdtemp(prefix="bench-writer-"))

    def arrow_transfer():  # JVM -> Arrow -> Python worker and back, nothing written
        acts.mapInArrow(lambda it: (b.slice(0, 0) for b in it), acts.schema).write.format(
            "noop"
        ).mode("overwrite").save()

    def ours(frame, name, **options):
        frame.write.format("safetensors").options(**options).mode("overwrite").save(str(out / name))

    spark.dataSource.register(_discarding_source())
    profile = {
        "scan only (noop sink)": lambda: acts.write.format("noop").mode("overwrite").save(),
        "scan + Arrow to Python (mapInArrow, noop)": arrow_transfer,
        "a Python data source that discards its input": lambda: (
            acts.write.format("discard").mode("overwrite").save()
        ),
        "the same, with the key column": lambda: (
            df.write.format("discard").mode("overwrite").save()
        ),
        "safetensors batch F32, checksum none": lambda: ours(
            acts, "f32n", batch_size=10_000, checksum="none"
        ),
    }
    cases = {
        "parquet (Spark's own)": lambda: acts.write.mode("overwrite").parquet(str(out / "pq")),
        "safetensors batch F32": lambda: ours(acts, "f32", batch_size=10_000),
        "safetensors batch F16": lambda: ours(acts, "f16", batch_size=10_000, dtype="F16"),
        "safetensors KV F32": lambda: ours(df, "kv", name_col="key"),
        "parquet with key (KV baseline)": lambda: df.write.mode("overwrite").parquet(
            str(out / "pqkv")
        ),
    }
    measured = interleaved_medians({**cases, **profile}, repeat=REPEAT, settle=os.sync)
    seconds = {name: measured[name] for name in cases}
    profiled = {name: measured[name] for name in profile}
    rows = []
    for name, s in seconds.items():
        base = seconds[
            "parquet with key (KV baseline)"
            if "KV" in name or "with key" in name
            else "parquet (Spark's own)"
        ]
        rows.append([name, f"{s:.2f}", f"{mb / s:.0f}", f"{base / s:.2f}x"])
    spark.stop()
    shutil.rmtree(out, ignore_errors=True)
    breakdown = [[name, f"{t:.2f}"] for name, t in profiled.items()]
    return (
        "## Spark writer: 200,000 × 256 float32, 2 partitions, local[2]\n\n"
        f"Cached DataFrame, warm, median of {REPEAT} runs in one session (cases taken in turn, "
        "dirty pages flushed before each run); "
        "MB/s of float32 input "
        f"({mb:.0f} MB). Batch mode uses batch_size=10,000; KV mode one tensor per row.\n\n"
        + table(["writer", "seconds", "MB/s", "vs parquet"], rows)
        + "\n\nWhere the time goes (same data, same session):\n\n"
        + table(["stage", "seconds"], breakdown)
    )


if __name__ == "__main__":
    start = time.time()
    print(run())
    print(f"{time.time() - start:.0f}s")
