"""Spark reader throughput: the writer benchmark's 200,000 x 256 float32 rows, written as a
batch dataset and a KV dataset, read back by the Python source (Spark 4.0 and newer), by
the floor of Spark's Python data source API, by Spark's parquet reader, by the JVM source
(jvm-shim) and, when ``SCALA_CONNECTOR_JAR`` names its jar, by the Scala safetensors
connector.

The floor is a throwaway Python data source that reads nothing: its tasks yield one
ready-made Arrow batch (the Python source's own first batch of that read, kept in an Arrow
file in the page cache and memory-mapped) again and again, as many rows as the read, in
one partition per core, into the same ``noop`` sink. What a Python source costs above it
is its own work; what the floor costs is Spark's: the batches' trip to the JVM and back
into rows.

One session (local[2]), warm page cache, cases taken in turn, median of ``REPEAT``. Cases:
each view into the noop sink, ``count()`` (the Python source's data view and its
``view=index``), and one column of a three-column dataset (a JVM read should cost that
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

REPEAT = 9
JVM_SOURCE = "io.github.pysparksafetensors.SafetensorsSource"
SHARD_ROWS = 10_000
FLOOR = "python_api_floor"


def _floor_source():
    """The floor of a Python data source's read: ``path`` names an Arrow file of one batch,
    ``rows`` how many rows to yield in all, ``partitions`` over how many tasks, ``schema``
    the read's schema as JSON. (Defined in a function so that workers get it by value.)"""
    import json

    from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
    from pyspark.sql.types import StructType

    class FloorReader(DataSourceReader):
        def __init__(self, options):
            self.path, self.rows = options["path"], int(options["rows"])
            self.parts = int(options["partitions"])

        def partitions(self):
            share = -(-self.rows // self.parts)
            return [
                InputPartition((a, min(a + share, self.rows))) for a in range(0, self.rows, share)
            ]

        def read(self, partition):
            import pyarrow as pa

            batch = pa.ipc.open_file(pa.memory_map(self.path)).get_batch(0)
            a, b = partition.value
            while a < b:
                yield batch.slice(0, min(batch.num_rows, b - a))
                a += batch.num_rows

    class FloorSource(DataSource):
        @classmethod
        def name(cls):
            return FLOOR

        def schema(self):
            return StructType.fromJson(json.loads(self.options["schema"]))

        def reader(self, schema):
            return FloorReader(self.options)

    return FloorSource


def _first_batch(path: str, out: Path, **options) -> tuple[Path, str, int]:
    """The Python source's first batch of a read, saved as an Arrow file for the floor:
    (its path, the read's schema as JSON, the read's row count)."""
    import pyarrow as pa

    from pyspark_safetensors.dataset import read_header
    from pyspark_safetensors.spark.reader import plan_read

    plan = plan_read({"path": path, **options})
    reader = plan.reader(plan.schema)
    batch = next(b for p in reader.partitions() for b in reader.read(p) if b.num_rows)
    rows = sum(
        len(read_header(source.location, f).tensors) if plan.view == "tensors" else s.samples_count
        for source in plan.sources
        for f, s in zip(source.files, source.manifest.shards, strict=True)
    )
    target = out / f"floor-{plan.view}.arrow"
    with pa.OSFile(str(target), "wb") as sink, pa.ipc.new_file(sink, batch.schema) as w:
        w.write_batch(batch)
    return target, plan.schema.json(), rows


def _datasets(spark, df, out: Path, writer: str) -> None:
    from pyspark.sql import functions as F

    acts = df.select("activation")
    acts.write.mode("overwrite").parquet(str(out / "pq"))
    df.write.mode("overwrite").parquet(str(out / "pqkv"))
    acts.write.format(writer).option("batch_size", SHARD_ROWS).mode("overwrite").save(
        str(out / "st")
    )
    df.write.format(writer).option("name_col", "key").mode("overwrite").save(str(out / "kv"))
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

    st, kv, three = str(out / "st"), str(out / "kv"), str(out / "three")
    parquet = lambda: spark.read.parquet(str(out / "pq"))  # noqa: E731
    cases = {
        "rows → noop | parquet": noop(parquet),
        "KV rows → noop | parquet": noop(lambda: spark.read.parquet(str(out / "pqkv"))),
        "count() | parquet": lambda: parquet().count(),
    }
    if python:
        parts = str(spark.sparkContext.defaultParallelism)
        ours = lambda path=st, **o: spark.read.format(PYTHON_SOURCE).options(**o).load(path)  # noqa: E731
        for op, path, options in (
            ("rows → noop", st, {}),
            ("KV rows → noop", kv, {}),
            ("tensors struct → noop", st, {"view": "tensors"}),
        ):
            batch, schema, rows = _first_batch(path, out, **options)
            floor = {"path": str(batch), "schema": schema, "rows": str(rows), "partitions": parts}
            cases[f"{op} | floor"] = noop(
                lambda o=floor: spark.read.format(FLOOR).options(**o).load()
            )
            cases[f"{op} | python"] = noop(lambda path=path, o=options: ours(path, **o))
        cases |= {
            "count() | python": lambda: ours().count(),
            "count() | python, view=index": lambda: ours(view="index").count(),
            "KV count() | python": lambda: ours(kv).count(),
            "KV count() | python, view=index": lambda: ours(kv, view="index").count(),
        }
    if jvm:
        jvm_read = lambda path=st, **o: spark.read.format(JVM_SOURCE).options(**o).load(path)  # noqa: E731
        cases |= {
            "rows → noop | jvm": noop(jvm_read),
            "KV rows → noop | jvm": noop(lambda: jvm_read(kv)),
            "count() | jvm": lambda: jvm_read().count(),
            "tensors struct → noop | jvm": noop(lambda: jvm_read(view="tensors")),
            "one column: activation (1024 B/row) | jvm": noop(
                lambda: jvm_read(three).select("activation")
            ),
            "one column: small (64 B/row) | jvm": noop(lambda: jvm_read(three).select("small")),
            "all three columns (2112 B/row) | jvm": noop(lambda: jvm_read(three)),
        }
    if scala:
        cases["tensors struct → noop | scala connector"] = noop(
            lambda: spark.read.format(SCALA_CONNECTOR).option("inferSchema", "true").load(st)
        )
    return cases


def run(repeat: int = REPEAT) -> str:
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
        spark.dataSource.register(_floor_source())
    out = Path(tempfile.mkdtemp(prefix="bench-reader-"))
    try:
        df = make_df(spark)
        _datasets(spark, df, out, PYTHON_SOURCE if python else JVM_SOURCE)
        df.unpersist()
        cases = _cases(
            spark, out, python, _has_class(spark, JVM_SOURCE), _has_class(spark, SCALA_CONNECTOR)
        )
        seconds = interleaved_medians(cases, repeat=repeat, settle=os.sync)
    finally:
        spark.stop()
        shutil.rmtree(out, ignore_errors=True)
    mb = ROWS * DIM * 4 / 1e6
    rows = []
    for name, s in seconds.items():
        op, reader = name.split(" | ")
        floor = seconds.get(f"{op} | floor")
        base = seconds.get(f"{op} | parquet")
        rows.append(
            [
                op,
                reader,
                f"{s:.2f}",
                f"{mb / s:.0f}",
                f"{floor / s:.2f}x" if floor and reader != "floor" else "",
                f"{base / s:.2f}x" if base else "",
            ]
        )
    return (
        f"## Spark reader: the {ROWS:,} × {DIM} float32 rows read back\n\n"
        f"One session, local[2], warm page cache, cases in turn, median of {repeat}; MB/s of "
        f"the float32 activations ({mb:.0f} MB). The batch dataset has shards of "
        f"{SHARD_ROWS:,} rows, the KV dataset one tensor per key. *floor*: a Python data "
        "source that yields a ready-made Arrow batch of the same schema from memory, one "
        "partition per core, into the same sink: the most a Python source can do (`vs floor`: "
        "the floor's seconds over the reader's, 1x is as fast). A Python data "
        "source gets no column pruning, so its `count()` reads every byte; `view=index` "
        "gives the same rows without the tensors (from the manifest and the tensor index). "
        "The JVM source answers `count()` from the manifest and reads only the selected "
        "columns' bytes.\n\n"
        + table(["operation", "reader", "seconds", "MB/s", "vs floor", "vs parquet"], rows)
    )


if __name__ == "__main__":
    print(run())
