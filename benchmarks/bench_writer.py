"""Spark writer throughput: our batch and KV modes, written by the Python source (where
Spark has Python data sources: 4.0 and newer) and by the JVM source (jvm-shim), against
Spark's parquet writer and, when ``SCALA_CONNECTOR_JAR`` names its jar, the Scala
safetensors connector.

One session (local[2]), a cached DataFrame of 200,000 rows x 256 float32 in 2 partitions,
warm, median of several runs, cases taken in turn. Throughput is input float32 bytes per
second. The noop sink (Spark scanning the cached rows and writing nothing) is the floor of
any writer.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

from benchmarks.common import interleaved_medians, table

ROWS, DIM, PARTS, REPEAT = 200_000, 256, 2, 5
JVM_SOURCE = "io.github.pysparksafetensors.SafetensorsSource"
"""The JVM source by class name: the Scala connector's jar registers ``safetensors`` too."""
SCALA_CONNECTOR = "io.github.semyonsinchenko.safetensors.SafetensorsTableProvider"
PYTHON_SOURCE = "safetensors_python"
"""The Python source under a name of its own: a jar that registers ``safetensors`` on the
JVM (ours or the Scala connector's) would otherwise take the format name."""


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


def _python_source():
    """The Python data source, registered as ``PYTHON_SOURCE``."""
    from pyspark_safetensors.spark.source import SafetensorsDataSource

    class PythonSource(SafetensorsDataSource):
        @classmethod
        def name(cls):
            return PYTHON_SOURCE

    return PythonSource


def _has_class(spark, name: str) -> bool:
    try:
        spark._jvm.org.apache.spark.util.Utils.classForName(name, True, False)
    except Exception:  # py4j wraps the ClassNotFoundException
        return False
    return True


def run() -> str:
    from pyspark_safetensors.spark.register import python_data_sources
    from pyspark_safetensors.spark.session import local_session
    from pyspark_safetensors.spark.shim import shim_jar

    jars = [str(shim_jar())]
    if os.environ.get("SCALA_CONNECTOR_JAR"):
        jars.append(os.environ["SCALA_CONNECTOR_JAR"])
    spark = local_session(
        "local[2]", **{"spark.ui.showConsoleProgress": "false", "spark.jars": ",".join(jars)}
    )
    df = make_df(spark)
    acts = df.select("activation")
    mb = ROWS * DIM * 4 / 1e6
    out = Path(tempfile.mkdtemp(prefix="bench-writer-"))

    def arrow_transfer():  # JVM -> Arrow -> Python worker and back, nothing written
        acts.mapInArrow(lambda it: (b.slice(0, 0) for b in it), acts.schema).write.format(
            "noop"
        ).mode("overwrite").save()

    def save(fmt):
        def write(frame, name, **options):
            frame.write.format(fmt).options(**options).mode("overwrite").save(str(out / name))

        return write

    jvm_source = JVM_SOURCE if _has_class(spark, JVM_SOURCE) else None
    ours, jvm, scala = save(PYTHON_SOURCE), save(jvm_source), save(SCALA_CONNECTOR)
    profile = {
        "scan only (noop sink)": lambda: acts.write.format("noop").mode("overwrite").save(),
        "scan + Arrow to Python (mapInArrow, noop)": arrow_transfer,
    }
    cases = {
        "parquet (Spark's own)": lambda: acts.write.mode("overwrite").parquet(str(out / "pq")),
        "parquet with key (KV baseline)": lambda: df.write.mode("overwrite").parquet(
            str(out / "pqkv")
        ),
    }
    if python_data_sources():  # Spark 4.0 and newer
        spark.dataSource.register(_discarding_source())
        spark.dataSource.register(_python_source())
        profile |= {
            "a Python data source that discards its input": lambda: (
                acts.write.format("discard").mode("overwrite").save()
            ),
            "the same, with the key column": lambda: (
                df.write.format("discard").mode("overwrite").save()
            ),
            "Python source batch F32, checksum none": lambda: ours(
                acts, "f32n", batch_size=10_000, checksum="none"
            ),
        }
        cases |= {
            "Python source batch F32": lambda: ours(acts, "f32", batch_size=10_000),
            "Python source batch F16": lambda: ours(acts, "f16", batch_size=10_000, dtype="F16"),
            "Python source KV F32": lambda: ours(df, "kv", name_col="key"),
        }
    if jvm_source is not None:
        cases["JVM source batch F32"] = lambda: jvm(acts, "jf32", batch_size=10_000)
        cases["JVM source batch F16"] = lambda: jvm(acts, "jf16", batch_size=10_000, dtype="F16")
        cases["JVM source KV F32"] = lambda: jvm(df, "jkv", name_col="key")
    if _has_class(spark, SCALA_CONNECTOR):  # its dtype option is required for arrays
        cases["Scala connector batch F32"] = lambda: scala(
            acts, "sf32", batch_size=10_000, dtype="F32"
        )
        cases["Scala connector batch F16"] = lambda: scala(
            acts, "sf16", batch_size=10_000, dtype="F16"
        )
        cases["Scala connector KV F32"] = lambda: scala(df, "skv", name_col="key", dtype="F32")
    measured = interleaved_medians({**cases, **profile}, repeat=REPEAT, settle=os.sync)
    seconds = {name: measured[name] for name in cases}
    profiled = {name: measured[name] for name in profile}
    floor = profiled["scan only (noop sink)"]
    rows = []
    for name, s in seconds.items():
        kv = "KV" in name or "with key" in name
        base = seconds["parquet with key (KV baseline)" if kv else "parquet (Spark's own)"]
        kind = "KV F32" if kv else "batch F16" if "F16" in name else "batch F32"
        connector = seconds.get(f"Scala connector {kind}")
        rows.append(
            [
                name,
                f"{s:.2f}",
                f"{mb / s:.0f}",
                f"{base / s:.2f}x",
                f"{connector / s:.2f}x" if connector and "parquet" not in name else "",
                f"{s - floor:.2f}",
            ]
        )
    spark.stop()
    shutil.rmtree(out, ignore_errors=True)
    breakdown = [[name, f"{t:.2f}"] for name, t in profiled.items()]
    return (
        "## Spark writer: 200,000 × 256 float32, 2 partitions, local[2]\n\n"
        f"Cached DataFrame, warm, median of {REPEAT} runs in one session (cases taken in turn, "
        "dirty pages flushed before each run); "
        "MB/s of float32 input "
        f"({mb:.0f} MB). Batch mode uses batch_size=10,000; KV mode one tensor per row. "
        "The Python and JVM sources write the same bytes; the Scala connector runs only when "
        "SCALA_CONNECTOR_JAR names its jar (it needs dtype=F32 for arrays).\n\n"
        + table(
            ["writer", "seconds", "MB/s", "vs parquet", "vs Scala connector", "above noop floor"],
            rows,
        )
        + "\n\nWhere the time goes (same data, same session):\n\n"
        + table(["stage", "seconds"], breakdown)
    )


if __name__ == "__main__":
    start = time.time()
    print(run())
    print(f"{time.time() - start:.0f}s")
