"""The ``safetensors`` PySpark data source."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceArrowWriter, WriterCommitMessage
from pyspark.sql.types import StructType

from ..dataset import TaskResult, split_storage_options
from .options import WriterOptions
from .writer import WriteJob


class SafetensorsDataSource(DataSource):
    """Write Spark DataFrames as safetensors datasets.

    Available as ``format("safetensors")`` with no registration call (Spark finds this
    class as ``pyspark_safetensors.DefaultSource``); ``spark.dataSource.register(
    SafetensorsDataSource)`` works too. Python data sources accept ``mode("append")`` and
    ``mode("overwrite")`` only: always pass one.

    Modes (exactly one of):

    - ``batch_size=N``: every N rows of a partition become one shard holding one tensor
      per column, shape ``[N, *sample_shape]``.
    - ``name_col=COL``: KV mode; each row becomes one tensor per other column, named
      ``{row[COL]}{kv_separator}{column}``; shards roll over at ``target_shard_size_mb``.

    Options (names are case-insensitive):

    ============================  ========================================================
    ``batch_size``                rows per shard (batch mode), 1..2^31-1
    ``name_col``                  string key column (KV mode)
    ``dtype``                     dtype of every numeric column, integer columns and Tensor
                                  Structs included (F16, F32, F64, BF16, U8, I8, U16, I16,
                                  U32, I32, U64, I64, or an alias: fp16, half, bfloat16,
                                  float, double, long, torch.float16, ...), or a JSON object
                                  ``{"column": "dtype"}`` for the columns it names (the
                                  others keep their own). Default: the column's own type
                                  (float→F32, double→F64, int→I32, long→I64, short→I16,
                                  byte→I8; structs keep theirs). F16/BF16 round floats to
                                  nearest even; every other cast is exact: overflow, a
                                  fraction, or an integer a float dtype cannot hold is an
                                  error naming the column and row.
    ``columns``                   comma-separated columns to write (default: all but the key)
    ``shapes``                    JSON ``{"column": [d0, d1, ...]}`` per-sample shapes for
                                  flat arrays; element counts are checked.
    ``tail_strategy``             ``write`` (default) | ``drop`` | ``pad`` (zeros) for the
                                  last incomplete batch of each partition
    ``duplicatesStrategy``        ``fail`` (default) | ``lastWin`` for a key repeated in a
                                  shard. Keys repeated across shards are always an error.
    ``kv_separator``              default ``__``
    ``target_shard_size_mb``      KV shard size, 50..1000, default 300 (a task holds up to
                                  two shards in memory)
    ``generate_index``            write ``_tensor_index.parquet`` (default: true in KV
                                  mode, false in batch mode)
    ``metadata``                  JSON object of strings, stored in every shard's
                                  ``__metadata__`` and in the manifest
    ``checksum``                  ``crc32c`` (default) per shard in the manifest, or ``none``
    ``keep_previous_generation``  overwrite only: ``true`` keeps the replaced dataset's
                                  files until the next commit, so readers that opened it
                                  can finish (default ``false``: deleted at commit)
    ============================  ========================================================

    Unknown options are refused with the closest valid name.

    Inputs: numeric arrays (nested too; every row must agree in batch mode), numeric
    scalars and Tensor Structs ``struct<data: binary, shape: array<int>, dtype: string>``.

    Writes are transactional: shards are staged per task attempt and published by the
    driver's commit, which writes the manifest last; a failed job leaves nothing (not even
    the directory, when it made it). An append is checked against the dataset's manifest
    on the driver before any task runs (columns, dtypes, ranks, batch size, key settings)
    and again at commit. This source writes no partitions, buckets or catalog entries:
    Spark hands a Python source no partition columns and refuses ``bucketBy`` on
    ``save()``, and ``saveAsTable`` or a catalog table hands it no path; use ``save(path)``
    and ``load(path)``, or the shim jar's JVM source, which writes partitioned datasets and
    catalog tables (``docs/sql.md``).

    Reading (``spark.read.format("safetensors").load(path)``): a dataset directory (shards
    listed by its manifest, never globbed) or its ``dataset_manifest.json``, a single
    ``.safetensors`` file, or a directory or glob of arbitrary safetensors files;
    ``load([path, ...])`` reads several of one view and schema as one DataFrame. Other
    files are refused on the driver. Read options:

    ============================  ========================================================
    ``view``                      ``rows`` (batch datasets: one row per sample), ``kv`` (KV
                                  datasets: one row per key), ``tensors`` (any file: one row
                                  per tensor ``file, name, dtype, shape, data``), ``files``
                                  (any file: one row per file, one Tensor Struct column per
                                  tensor name), ``index`` (datasets: the rows of ``rows``/
                                  ``kv`` with each tensor's dtype and shape, no bytes: from
                                  the manifest and the tensor index; the fast ``count()``).
                                  Default: the dataset's mode; for plain files
                                  ``tensors``, or ``files`` with ``inferSchema=true`` or a
                                  given schema of Tensor Struct columns.
    ``inferSchema``               accepted (the header always gives the schema); ``true``
                                  picks the files view for plain files
    ``tensor_format``             ``array`` (default; F16/BF16 widen to float) or
                                  ``struct`` (Tensor Structs with the stored bytes)
    ``include_data``              tensors view: ``false`` lists headers only, reading no
                                  tensor bytes
    ``rows_per_partition``        rows view: one partition per range of this many rows of
                                  each shard (default: shards and ranges packed into
                                  partitions of about 128 MiB)
    ============================  ========================================================

    Streaming (``docs/streaming.md``): ``df.writeStream.format("safetensors")`` appends each
    micro-batch, exactly once across restarts (its batch id recorded in the manifest's
    ``stream_commits`` under the query's id, or under the option ``stream_id``, refused
    under another checkpoint than its own), output mode ``append`` only, with the writer's
    options; ``spark.readStream.format("safetensors").load(path)`` gives the rows of each
    commit that lands on a dataset, in the reader's views and options, a micro-batch capped
    by ``maxFilesPerTrigger`` (shards) or ``maxRowsPerTrigger`` (rows in whole shards) on
    Spark 4.2 and newer.

    Example::

        (df.write.format("safetensors")
           .option("batch_size", 4096).option("dtype", "F16")
           .mode("overwrite").save("/data/acts"))
    """

    @classmethod
    def name(cls) -> str:
        return "safetensors"

    def schema(self) -> StructType:
        return self._read_plan().schema

    def reader(self, schema: StructType):
        return self._read_plan().reader(schema)

    def _read_plan(self):
        """The read's plan, made once per query: Spark pickles this instance after
        ``schema()`` and calls ``reader()`` on the copy, so the plan (manifests loaded,
        shards stat-ed) travels with it; it is made again only when a manifest changed."""
        from .reader import plan_read

        plan = self.__dict__.get("_plan")
        if plan is None or not plan.is_current():
            plan = self._plan = plan_read(self.options)
        return plan

    def streamWriter(self, schema: StructType, overwrite: bool):
        """The streaming sink (``docs/streaming.md``): each micro-batch one append,
        exactly once by its batch id; output mode append only."""
        from .stream import stream_writer

        return stream_writer(self.options, schema, overwrite)

    def streamReader(self, schema: StructType):
        """The streaming source: the rows of each commit that lands on the dataset."""
        from .stream import SafetensorsStreamReader

        return SafetensorsStreamReader(self._read_plan(), schema)

    def writer(self, schema: StructType, overwrite: bool) -> SafetensorsWriter:
        storage, options = split_storage_options(self.options)
        return SafetensorsWriter(WriteJob(WriterOptions.parse(options), schema, overwrite, storage))


@dataclass
class TaskCommit(WriterCommitMessage):
    """The commit message of one task attempt."""

    result: TaskResult


class SafetensorsWriter(DataSourceArrowWriter):
    """The data source's front end of a ``WriteJob``: planned on the driver, written in
    tasks, committed on the driver."""

    def __init__(self, job: WriteJob):
        self.job = job

    def write(self, iterator: Iterator[pa.RecordBatch]) -> WriterCommitMessage:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        task_id = ctx.partitionId() if ctx else 0
        attempt_id = ctx.taskAttemptId() if ctx else 0
        return TaskCommit(self.job.write_partition(iterator, task_id, attempt_id))

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        self.job.commit([m.result for m in messages if isinstance(m, TaskCommit)])

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        self.job.abort()
