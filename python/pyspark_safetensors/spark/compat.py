"""What this package reads of Spark's internals, and what differs between Spark lines, in
one place.

Spark 3.5 has neither ``DataFrame.toArrow()`` nor ``createDataFrame`` from a pyarrow
``Table`` (both Spark 4.0): :func:`to_arrow` and :func:`from_arrow` are the one route for
every line.

Spark's Python data source API does not tell a data source whether filter pushdown is on
(``spark.sql.python.filterPushdown.enabled``), yet Spark >= 4.1 fails a read whose reader
implements ``pushFilters`` while it is off. The planning worker
(``pyspark.sql.worker.plan_data_source_read``) holds the setting in a local variable of
its ``_main`` function while it calls ``DataSource.reader()``; this module reads it from
there. A test runs a real read and fails loudly if Spark renames either.
"""

from __future__ import annotations

import sys

import pyarrow as pa

PLANNING_FUNCTION = "_main"
"""The function of Spark's read-planning worker that calls ``DataSource.reader()``."""

PUSHDOWN_FLAG = "enable_pushdown"
"""Its local variable holding ``spark.sql.python.filterPushdown.enabled``."""


STREAM_QUERY_ID = "sql.streaming.queryId"
"""The task-local property Spark's stream execution sets to its query's id: the id the
query's checkpoint keeps (its ``metadata`` file), so a restart from it has the same one;
what the JVM hands a streaming sink as ``LogicalWriteInfo.queryId()``. A Python stream
writer is told neither, its tasks read it here."""

STREAM_BATCH_ID = "streaming.sql.batchId"
"""The task-local property holding the micro-batch's id (the ``batchId`` the stream
writer's ``commit`` gets)."""


def stream_task_ids(context) -> tuple[str | None, int | None]:
    """(query id, batch id) of the micro-batch the task of ``context`` (a
    ``TaskContext``) computes; None for what Spark did not set."""
    query = context.getLocalProperty(STREAM_QUERY_ID) or None
    batch = context.getLocalProperty(STREAM_BATCH_ID)
    return query, int(batch) if batch not in (None, "") else None


def planning_pushdown_flag() -> bool | None:
    """The planning worker's filter-pushdown setting, or None when this call does not run
    inside Spark's read planning (or Spark's internals moved)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == PLANNING_FUNCTION and PUSHDOWN_FLAG in frame.f_locals:
            return bool(frame.f_locals[PUSHDOWN_FLAG])
        frame = frame.f_back
    return None


def pushdown_enabled() -> bool:
    """Whether the reader may push filters: only when Spark's planning worker says the
    setting is on. When the flag cannot be found no filters are pushed (correct, only
    slower)."""
    return planning_pushdown_flag() is True


def to_arrow(df):
    """``df`` collected as a pyarrow ``Table``: ``toArrow()`` where Spark has it (4.0 and
    newer, classic and Connect), else the Arrow batches a classic 3.5 session collects for
    ``toPandas``."""
    if hasattr(df, "toArrow"):
        return df.toArrow()
    from pyspark.sql.pandas.types import to_arrow_schema

    return pa.Table.from_batches(df._collect_as_arrow(), schema=to_arrow_schema(df.schema))


def from_arrow(spark, table):
    """A DataFrame of the pyarrow ``table``: ``createDataFrame(table)`` where Spark takes a
    Table (4.0 and newer), else its record batches handed to the JVM as Arrow, the way a
    classic 3.5 session's ``createDataFrame`` hands a pandas frame (whose conversion would
    turn NaN into null)."""
    if spark_major() >= 4:
        return spark.createDataFrame(table)
    from pyspark.sql import DataFrame
    from pyspark.sql.pandas.serializers import ArrowStreamSerializer
    from pyspark.sql.pandas.types import from_arrow_schema

    jvm = spark._jvm
    batches = table.combine_chunks().to_batches() or [
        pa.RecordBatch.from_pylist([], schema=table.schema)
    ]
    stream = spark.sparkContext._serialize_to_jvm(
        batches,
        ArrowStreamSerializer(),
        jvm.PythonSQLUtils.readArrowStreamFromFile,
        jvm.ArrowIteratorServer,
    )
    schema = from_arrow_schema(table.schema)
    return DataFrame(
        jvm.PythonSQLUtils.toDataFrame(stream, schema.json(), spark._jsparkSession), spark
    )


def spark_major() -> int:
    """The running pyspark's major version (3 or 4)."""
    import pyspark

    return int(pyspark.__version__.split(".")[0])


PARALLELISM_PROBE_ROWS = 1 << 16
"""Rows of the ``range()`` whose partition count gives a Connect session's default
parallelism (more rows than any session has cores, so every partition is used)."""


def default_parallelism(spark) -> int:
    """The session's default parallelism, on classic and Connect sessions alike: the
    SparkContext's, else (Connect has no ``sparkContext`` to ask) the partition count
    Spark gives ``range()``, found by one tiny job (seconds, when it is the session's
    first)."""
    from pyspark.sql import functions as F

    if not type(spark).__module__.startswith("pyspark.sql.connect"):
        return spark.sparkContext.defaultParallelism
    parts = spark.range(0, PARALLELISM_PROBE_ROWS).select(F.spark_partition_id().alias("p"))
    (last,) = parts.agg(F.max("p")).first()
    return int(last) + 1
