"""The ``safetensors`` PySpark data source."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceArrowWriter, WriterCommitMessage
from pyspark.sql.types import StringType, StructType

from ..dataset import (
    MANIFEST,
    ColumnSchema,
    DatasetLocation,
    Manifest,
    abort_dataset,
    begin_job,
    check_append,
    check_kv_columns,
    commit_dataset,
    load_manifest,
    split_storage_options,
)
from .columns import ColumnError, ColumnPlan, plan_column
from .options import WriterOptions
from .writer import TaskCommit, write_partition


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
                                  tensor name). Default: the dataset's mode; for plain files
                                  ``tensors``, or ``files`` with ``inferSchema=true`` or a
                                  given schema of Tensor Struct columns.
    ``inferSchema``               accepted (the header always gives the schema); ``true``
                                  picks the files view for plain files
    ``tensor_format``             ``array`` (default; F16/BF16 widen to float) or
                                  ``struct`` (Tensor Structs with the stored bytes)
    ``include_data``              tensors view: ``false`` lists headers only, reading no
                                  tensor bytes
    ``rows_per_partition``        rows view: shards larger than this (default 65,536) are
                                  split into row ranges
    ============================  ========================================================

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

    def writer(self, schema: StructType, overwrite: bool) -> SafetensorsWriter:
        storage, options = split_storage_options(self.options)
        return SafetensorsWriter(WriterOptions.parse(options), schema, overwrite, storage)


class SafetensorsWriter(DataSourceArrowWriter):
    """Plans on the driver (options, column types), writes in tasks, commits on the driver."""

    def __init__(
        self,
        options: WriterOptions,
        schema: StructType,
        overwrite: bool,
        storage_options: dict[str, str] | None = None,
    ):
        self.options = options
        self.overwrite = overwrite
        self.location = DatasetLocation.of(options.path, storage_options=storage_options)
        self.job_id = uuid.uuid4().hex
        self.plans = self._plan(schema)
        if not overwrite:
            self._check_append()
        self.created = not self.location.exists()
        """Whether this job made the dataset's directory (a failed job then removes it)."""
        begin_job(self.location, self.job_id)

    def _plan(self, schema: StructType):
        names = [f.name for f in schema.fields]
        o = self.options
        unknown = [c for c in [*(o.columns or ()), *o.shapes, *o.column_dtypes] if c not in names]
        if unknown:
            raise ColumnError(
                f"option names column(s) {unknown} that the DataFrame lacks; its columns: {names}"
            )
        if o.name_col is not None:
            if o.name_col not in names:
                raise ColumnError(f"name_col {o.name_col!r} is not a column; columns: {names}")
            if not isinstance(schema[o.name_col].dataType, StringType):
                raise ColumnError(
                    f"name_col {o.name_col!r} has type {schema[o.name_col].dataType.simpleString()}; the key column must be a string"
                )
        wanted = o.columns or tuple(n for n in names if n != o.name_col)
        if o.name_col in wanted:
            raise ColumnError(
                f"columns lists the key column {o.name_col!r}; it is written as part of each tensor name"
            )
        if not wanted:
            raise ColumnError("no tensor columns to write")
        if o.name_col is not None:
            try:
                check_kv_columns(wanted, o.kv_separator)
            except ValueError as e:
                raise ColumnError(str(e)) from None
        return [plan_column(n, schema[n].dataType, o) for n in wanted]

    def _check_append(self) -> None:
        """Refuse, before any task runs, an append the dataset cannot take: what the
        DataFrame's types tell (dtypes, ranks, scalar and ``shapes`` sample shapes) is
        checked with the commit's rule; dimensions of variable-length arrays are known
        only once written, and the commit checks them."""
        if not self.location.has(MANIFEST):
            return
        previous = load_manifest(self.location)
        where = f"dataset {self.location.uri!r}"
        known = {p.name: _known_schema(p, previous.schema.get(p.name)) for p in self.plans}
        check_append(previous, self._template(), known, where)

    def write(self, iterator: Iterator[pa.RecordBatch]) -> WriterCommitMessage:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        task_id = ctx.partitionId() if ctx else 0
        attempt_id = ctx.taskAttemptId() if ctx else 0
        return write_partition(
            self.options,
            self.plans,
            self.location,
            iterator,
            task_id,
            attempt_id,
            self.job_id,
            made_directory=self.created,
        )

    def _template(self) -> Manifest:
        o = self.options
        return Manifest(
            shards=(),
            schema={},
            mode=o.mode,
            batch_size=o.batch_size,
            name_col=o.name_col,
            kv_separator=o.kv_separator if o.mode == "kv" else None,
            metadata=dict(o.metadata),
        )

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        results = [m.result for m in messages if isinstance(m, TaskCommit)]
        try:
            commit_dataset(
                self.location,
                self.job_id,
                results,
                self._template(),
                overwrite=self.overwrite,
                generate_index=self.options.generate_index,
                unique_keys=self.options.mode == "kv",
                keep_previous_generation=self.options.keep_previous_generation,
            )
        except BaseException:
            self.abort(messages)
            raise

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        abort_dataset(self.location, self.job_id)
        if self.created:
            self.location.remove_if_empty()


def _known_schema(plan: ColumnPlan, previous: ColumnSchema | None) -> ColumnSchema:
    """What the DataFrame's type tells of a column's dtype and sample shape; what it
    leaves open (a struct's dtype, an array's dimensions) is taken from ``previous``
    (the dataset's column), so that only what is known can disagree. Open dimensions of
    a rank the dataset does not have show as -1."""
    dtype = plan.target or (previous.dtype if previous else "")
    if plan.shape is not None or plan.kind == "scalar":
        sample = tuple(plan.shape or ())
    elif previous is not None and (
        plan.kind == "struct" or len(previous.sample_shape) == plan.depth
    ):
        sample = tuple(previous.sample_shape)
    else:
        sample = (-1,) * plan.depth
    return ColumnSchema(dtype, sample, sample)
