"""Spark reader throughput: the writer benchmark's 200,000 x 256 float32 dataset read back
by Spark's parquet reader, the Python source (Spark 4.0 and newer), the JVM source
(jvm-shim) and, when ``SCALA_CONNECTOR_JAR`` names its jar, the Scala safetensors
connector.

One session (local[2]), warm page cache, cases taken in turn, median of ``REPEAT``. Cases:
the rows view into the noop sink, ``count()``, the tensors view with Tensor Structs into
the noop sink, and one column of a three-column dataset (a JVM read should cost that
column's bytes only).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from benchmarks.bench_writer import (
    DIM,
    PYTHON_SOURCE,
    ROWS,
    SCALA_CONNECTOR,
    _has_class,
    _python_source,
    make_df,
)
from benchmarks.common import interleaved_medians, table

REPEAT = 5
JVM_SOURCE = "io.github.pysparksafetensors.SafetensorsSource"
SHARD_ROWS = 10_000


def _datasets(spark, df, out: Path, writer: str) -> None:
    from pyspark.sql import functions as F

    acts = df.select("activation")
    acts.write.mode("overwrite").parquet(str(out / "pq"))
    acts.write.format(writer).option("batch_size", SHARD_ROWS).mode("overwrite").save(
        str(out / "st")
    )
    three = df.select(
        "activation",
        F.reverse("activation").alias("other"),
        F.slice("activation", 1, 16).alias("small"),
    )
    three.write.format(writer).option("batch_size", SHARD_ROWS).mode("overwrite").save(
        str(out / "three")
    )


def _cases(spark, out: Path, python: bool, jvm: bool, scala: bool) -> dict:
    def noop(frame):
        return lambda: frame().write.format("noop").mode("overwrite").save()

    st, three = str(out / "st"), str(out / "three")
    parquet = lambda: spark.read.parquet(str(out / "pq"))  # noqa: E731
    cases = {
        "rows → noop | parquet": noop(parquet),
        "count() | parquet": lambda: parquet().count(),
    }
    if python:
        ours = lambda **o: spark.read.format(PYTHON_SOURCE).options(**o).load(st)  # noqa: E731
        cases |= {
            "rows → noop | python": noop(ours),
            "count() | python": lambda: ours().count(),
            "tensors struct → noop | python": noop(lambda: ours(view="tensors")),
        }
    if jvm:
        ours = lambda path=st, **o: spark.read.format(JVM_SOURCE).options(**o).load(path)  # noqa: E731
        cases |= {
            "rows → noop | jvm": noop(ours),
            "count() | jvm": lambda: ours().count(),
            "tensors struct → noop | jvm": noop(lambda: ours(view="tensors")),
            "one column: activation (1024 B/row) | jvm": noop(
                lambda: ours(three).select("activation")
            ),
            "one column: small (64 B/row) | jvm": noop(lambda: ours(three).select("small")),
            "all three columns (2112 B/row) | jvm": noop(lambda: ours(three)),
        }
    if scala:
        cases["tensors struct → noop | scala connector"] = noop(
            lambda: spark.read.format(SCALA_CONNECTOR).option("inferSchema", "true").load(st)
        )
    return cases


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
    python = python_data_sources()  # Spark 4.0 and newer
    if python:
        spark.dataSource.register(_python_source())
    out = Path(tempfile.mkdtemp(prefix="bench-reader-"))
    try:
        df = make_df(spark)
        _datasets(spark, df, out, PYTHON_SOURCE if python else JVM_SOURCE)
        df.unpersist()
        cases = _cases(
            spark, out, python, _has_class(spark, JVM_SOURCE), _has_class(spark, SCALA_CONNECTOR)
        )
        seconds = interleaved_medians(cases, repeat=REPEAT, settle=os.sync)
    finally:
        spark.stop()
        shutil.rmtree(out, ignore_errors=True)
    mb = ROWS * DIM * 4 / 1e6
    rows = []
    for name, s in seconds.items():
        op, reader = name.split(" | ")
        base = seconds.get(f"{op} | parquet")
        rows.append([op, reader, f"{s:.2f}", f"{mb / s:.0f}", f"{base / s:.2f}x" if base else ""])
    return (
        "## Spark reader: the 200,000 × 256 float32 dataset read back\n\n"
        f"One session, local[2], warm page cache, cases in turn, median of {REPEAT}; MB/s of "
        f"the float32 activations ({mb:.0f} MB). The Python source gets no column pruning "
        "(a Python data source), so its `count()` builds every row; the JVM source answers "
        "`count()` from the manifest and reads only the selected columns' bytes.\n\n"
        + table(["operation", "reader", "seconds", "MB/s", "vs parquet"], rows)
    )


if __name__ == "__main__":
    print(run())
