"""A write job: ``WriteJob`` plans it on the driver (column plans, the append check, the
job's lease), each task writes its partition with a ``PartitionWriter`` (Arrow batches in,
shards out at the dataset root under names of this attempt's own, trusted by no reader
until the commit lists them, one ``TaskResult`` back), and ``WriteJob.commit`` publishes
them. The data source's writer (``source.py``) is one front end; a stage that writes
datasets as it computes them (the extraction's model stage) is another: it carries the
``WriteJob`` into its own tasks. Nothing here needs Spark's Python Data Source API."""

from __future__ import annotations

import contextlib
import copy
import uuid
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import pyarrow as pa
from pyspark.sql.types import StringType, StructType

from .._version import __version__
from ..dataset import (
    FORMAT_VERSION,
    MANIFEST,
    ColumnSchema,
    DatasetLocation,
    Manifest,
    StagedShard,
    TaskResult,
    abort_dataset,
    attempt_uuid,
    begin_job,
    check_append,
    check_kv_columns,
    commit_dataset,
    index_rows,
    index_table,
    kv_tensor_name,
    lease_name,
    load_manifest,
    merge_schemas,
    shard_name,
)
from ..format import ChunkedTensor, PackedTensors, dtype_of, write_packed, write_shard
from .columns import ColumnError, ColumnPlan, decode_batch_column, decode_kv_column, plan_column
from .options import WriterOptions


class JobEndedError(RuntimeError):
    """A task attempt finished after its job was aborted or committed."""


class _Checksum:
    """The running crc32c of a file being written, or nothing when checksums are off."""

    def __init__(self, kind: str):
        self.value = 0 if kind == "crc32c" else None
        if self.value is not None:
            # imported by the tasks that write, not by each Spark planner process that
            # imports this module: crc32c's import looks up its own version among every
            # distribution on the path (25 to 50 ms)
            from crc32c import crc32c

            self._crc32c = crc32c

    def update(self, data) -> None:
        if self.value is not None:
            self.value = self._crc32c(data, self.value)

    def hex(self) -> str | None:
        return None if self.value is None else f"{self.value:08x}"


class _ShardSink:
    """Writes shards for one task attempt, on a background thread, and remembers what it
    wrote."""

    def __init__(
        self,
        options: WriterOptions,
        location: DatasetLocation,
        task_id: int,
        attempt_id: int,
        file_uuid: str,
        lease: str,
    ):
        self.options = options
        self.lease = lease
        self.location = location
        self.task_id = task_id
        self.attempt_id = attempt_id
        self.file_uuid = file_uuid
        self.started: list[str] = []
        self.shards: list[StagedShard] = []
        self.in_flight: deque[Future] = deque()
        self.io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-writer")
        self.schema: dict[str, ColumnSchema] = {}
        self.metadata = {
            "format": "pt",
            "format_version": FORMAT_VERSION,
            "writer": f"pyspark-safetensors {__version__}",
            **options.metadata,
        }

    def write(self, tensors: dict, samples: int) -> None:
        """Write one shard of whole tensors (batch mode)."""

        def write(name, path, checksum):
            header = write_shard(path, tensors, self.metadata, on_bytes=checksum.update)
            index = index_rows(name, header) if self.options.generate_index else None
            return header.file_size, index

        self._submit(write, samples)

    def write_packed(self, groups: list, samples: int) -> None:
        """Write one shard of many packed tensors (KV mode); always indexed."""

        def write(name, path, checksum):
            layout = write_packed(path, groups, self.metadata, on_bytes=checksum.update)
            return layout.file_size, index_table(name, layout)

        self._submit(write, samples)

    def _submit(self, write, samples: int) -> None:
        """Write the next shard on the background thread (file writes, checksum and fsync
        release the GIL, so they overlap the decoding of the next batches). One shard is
        written while the next fills: a task holds at most two shards' data."""
        shard_index = len(self.shards) + len(self.in_flight)
        name = shard_name(self.task_id, shard_index, self.file_uuid)

        self.started.append(name)

        def job():
            checksum = _Checksum(self.options.checksum)
            size, index = self.location.write_shard(name, lambda path: write(name, path, checksum))
            return StagedShard(
                task_id=self.task_id,
                shard_index=shard_index,
                final_name=name,
                samples_count=samples,
                bytes=size,
                crc32c=checksum.hex(),
                index=index,
            )

        self.in_flight.append(self.io.submit(job))
        while len(self.in_flight) > 1:
            self.shards.append(self.in_flight.popleft().result())

    def note_schema(self, column: str, dtype: str, sample_shape: tuple[int, ...]) -> None:
        """Record a column's dtype and sample shape; the commit's merge rule applies here
        too (batch mode: must agree; KV mode: differing dims become -1)."""
        col = ColumnSchema(dtype, sample_shape, sample_shape)
        if self.schema.get(column) != col:
            self.schema = merge_schemas(
                [self.schema, {column: col}],
                f"partition {self.task_id}",
                varying=self.options.mode == "kv",
            )

    def result(self) -> TaskResult:
        """Wait for every shard to be stored; the task's commit message.

        Spark may abort (or commit) a job while a slow attempt still writes. The driver
        drops the job's lease before it lists what to delete, so an attempt that checks
        the lease after its last shard landed either was seen by that listing or sees
        the lease gone and deletes its own shards: no orphan either way."""
        while self.in_flight:
            self.shards.append(self.in_flight.popleft().result())
        self.io.shutdown()
        if not self.location.has(self.lease):
            raise JobEndedError(
                "the write job ended (aborted or committed without this attempt) before "
                "this task finished; its shards are deleted"
            )
        return TaskResult(self.attempt_id, tuple(self.shards), self.schema)

    def discard(self) -> None:
        """Stop writing and delete everything this attempt wrote."""
        self.io.shutdown(wait=True, cancel_futures=True)
        with contextlib.suppress(OSError):  # the driver's commit or abort reclaims the rest
            self.location.delete(self.started)


class BatchModeWriter:
    """Every ``batch_size`` rows of a partition become one shard, one tensor per column."""

    def __init__(self, options: WriterOptions, plans: list[ColumnPlan], sink: _ShardSink):
        self.options = options
        self.plans = plans
        self.sink = sink
        self.pending: dict[str, list[np.ndarray]] = {p.name: [] for p in plans}
        self.pending_rows = 0
        self.rows_seen = 0

    def add(self, batch: pa.RecordBatch) -> None:
        rows = batch.num_rows
        if rows == 0:
            return
        for plan in self.plans:
            chunk = decode_batch_column(batch.column(plan.name), plan, self.rows_seen)
            self.sink.note_schema(plan.name, dtype_of(chunk).name, chunk.shape[1:])
            self.pending[plan.name].append(chunk)
        self.rows_seen += rows
        self.pending_rows += rows
        while self.pending_rows >= self.options.batch_size:
            self._emit(self.options.batch_size)

    def _take(self, column: str, n: int) -> list[np.ndarray]:
        taken, chunks, need = [], self.pending[column], n
        while need:
            head = chunks[0]
            if len(head) <= need:
                taken.append(chunks.pop(0))
                need -= len(head)
            else:
                taken.append(head[:need])
                chunks[0] = head[need:]
                need = 0
        return taken

    def _emit(self, n: int, pad_to: int | None = None) -> None:
        tensors = {}
        for plan in self.plans:
            parts = self._take(plan.name, n)
            sample = parts[0].shape[1:]
            if pad_to is not None and pad_to > n:
                parts.append(np.zeros((pad_to - n, *sample), dtype=parts[0].dtype))
            rows = pad_to or n
            tensors[plan.name] = ChunkedTensor(
                dtype_of(parts[0]), (rows, *sample), tuple(p.reshape(-1) for p in parts)
            )
        self.pending_rows -= n
        self.sink.write(tensors, pad_to or n)

    def finish(self) -> None:
        if not self.pending_rows:
            return
        strategy = self.options.tail_strategy
        if strategy == "write":
            self._emit(self.pending_rows)
        elif strategy == "pad":
            self._emit(self.pending_rows, pad_to=self.options.batch_size)
        # "drop": the incomplete last batch is discarded


@dataclass
class _Rows:
    """Consecutive KV rows of one Arrow batch: keys, one packed tensor per row and column,
    and which rows are still live (``lastWin`` retires a replaced row)."""

    keys: list[str]
    columns: dict[str, PackedTensors]
    sizes: np.ndarray
    """Bytes of each row over all columns."""
    live: np.ndarray | None = None
    """Boolean mask; None while every row is live."""

    def take(self, start: int, stop: int) -> _Rows:
        part = slice(start, stop)
        columns = {name: packed.take(part) for name, packed in self.columns.items()}
        return _Rows(self.keys[part], columns, self.sizes[part])

    @cached_property
    def position(self) -> dict[str, int]:
        return {key: i for i, key in enumerate(self.keys)}

    def retire(self, key: str) -> int | None:
        """Mark the live row of ``key`` replaced; its bytes, or None if it is not here."""
        i = self.position.get(key)
        if i is None or (self.live is not None and not self.live[i]):
            return None
        if self.live is None:
            self.live = np.ones(len(self.keys), dtype=bool)
        self.live[i] = False
        return int(self.sizes[i])


class KVModeWriter:
    """One tensor per row and non-key column, keyed ``{key}{sep}{column}``; shards roll
    over at ``target_shard_size_mb``.

    Rows stay in their Arrow batches' cast buffers until a shard is sealed; then the
    header is laid out and the bytes gathered in bulk (``format.write_packed``), so the
    work per row is a few list and numpy operations, not Python objects per tensor."""

    def __init__(self, options: WriterOptions, plans: list[ColumnPlan], sink: _ShardSink):
        self.options = options
        self.plans = plans
        self.sink = sink
        self.limit = options.target_shard_size_mb * 1_000_000
        self.blocks: list[_Rows] = []
        self.keys: set[str] = set()
        self.current_bytes = 0
        self.current_rows = 0

    def add(self, batch: pa.RecordBatch) -> None:
        if batch.num_rows == 0:
            return
        key_col = batch.column(self.options.name_col)
        if key_col.null_count:
            raise ColumnError(
                f"key column {self.options.name_col!r} holds a null key; every row needs a key"
            )
        keys = key_col.to_pylist()
        columns = {p.name: decode_kv_column(batch.column(p.name), p, keys) for p in self.plans}
        for name, packed in columns.items():
            for dtype, shape in packed.specs:
                self.sink.note_schema(name, dtype.name, shape)
        rows = _Rows(keys, columns, np.sum([p.sizes for p in columns.values()], axis=0))
        if len(set(keys)) == len(keys) and self.keys.isdisjoint(keys):
            self._append(rows)
            return
        # Duplicate keys: the runs between repeated keys in bulk, the repeats one by one.
        seen, start = set(), 0
        for i, key in enumerate(keys):
            if key in self.keys or key in seen:
                if start < i:
                    self._append(rows.take(start, i))
                self._append_one(rows.take(i, i + 1))
                start = i + 1
            seen.add(key)
        if start < len(keys):
            self._append(rows.take(start, len(keys)))

    def _append(self, rows: _Rows) -> None:
        """Add rows, sealing the shard whenever the next row would overflow it (a row
        larger than the limit gets a shard of its own)."""
        total = np.cumsum(rows.sizes)
        start = 0
        while start < len(rows.keys):
            before = int(total[start - 1]) if start else 0
            stop = int(np.searchsorted(total, before + self.limit - self.current_bytes, "right"))
            if stop == start:
                if self.blocks:
                    self._seal()
                    continue
                stop = start + 1
            self._keep(rows.take(start, stop) if (start, stop) != (0, len(rows.keys)) else rows)
            start = stop

    def _append_one(self, row: _Rows) -> None:
        key = row.keys[0]
        if key in self.keys:
            if self.options.duplicates_strategy == "fail":
                raise ColumnError(
                    f"duplicate key {key!r} in column {self.options.name_col!r} (duplicatesStrategy=fail; use lastWin to keep the last row)"
                )
            replaced = next(r for b in reversed(self.blocks) if (r := b.retire(key)) is not None)
            self.current_bytes -= replaced
            self.current_rows -= 1
            self._keep(row)
        else:
            self._append(row)

    def _keep(self, rows: _Rows) -> None:
        self.blocks.append(rows)
        self.keys.update(rows.keys)
        self.current_bytes += int(rows.sizes.sum())
        self.current_rows += len(rows.keys)

    def _seal(self) -> None:
        groups = []
        for block in self.blocks:
            live = None if block.live is None else np.flatnonzero(block.live)
            keys = block.keys if live is None else [block.keys[i] for i in live.tolist()]
            for p in self.plans:
                packed = block.columns[p.name]
                sep = self.options.kv_separator
                names = [kv_tensor_name(key, p.name, sep) for key in keys]
                groups.append((names, packed if live is None else packed.take(live)))
        self.sink.write_packed(groups, self.current_rows)
        self.blocks, self.keys, self.current_bytes, self.current_rows = [], set(), 0, 0

    def finish(self) -> None:
        if self.blocks:
            self._seal()


class PartitionWriter:
    """One task attempt's part of a write job: ``add`` its Arrow batches, then ``finish``
    (the attempt's ``TaskResult``, for the driver's commit); on an error ``discard``
    deletes what it wrote."""

    def __init__(self, job: WriteJob, task_id: int, attempt_id: int):
        self.job = job
        self.sink = _ShardSink(
            job.options, job.location, task_id, attempt_id, attempt_uuid(job.job_id),
            lease_name(job.job_id),
        )  # fmt: skip
        mode = KVModeWriter if job.options.mode == "kv" else BatchModeWriter
        self.writer = mode(job.options, job.plans, self.sink)

    def add(self, batch: pa.RecordBatch) -> None:
        self.writer.add(batch)

    def finish(self) -> TaskResult:
        self.writer.finish()
        return self.sink.result()

    def discard(self) -> None:
        self.sink.discard()
        if self.job.created:  # an attempt that outlived a failed job removes its directory
            with contextlib.suppress(OSError):  # best effort, as the discard above
                self.job.location.remove_if_empty()


class WriteJob:
    """One dataset write, planned on the driver and pickled into its tasks.

    ``schema``: the rows' Spark schema; the columns written and their plans follow the
    options (``WriterOptions``). An append is checked against the dataset's manifest
    before any task runs (what the types tell: columns, dtypes, ranks, batch size, key
    settings) and again at commit. Making the job takes its lease, so the job must end in
    ``commit`` or ``abort``; a failed job leaves nothing, not even the directory when it
    made it."""

    def __init__(
        self,
        options: WriterOptions,
        schema: StructType,
        overwrite: bool,
        storage_options: dict[str, str] | None = None,
        *,
        lease: bool = True,
    ):
        """``lease=False``: no job is begun here; the caller runs jobs of its own through
        ``for_job`` and leases each (a stream's micro-batches, leased by their tasks)."""
        self.options = options
        self.overwrite = overwrite
        self.location = DatasetLocation.of(options.path, storage_options=storage_options)
        self.job_id = uuid.uuid4().hex
        self.plans = self._plan(schema)
        if not overwrite:
            self._check_append()
        self.created = not self.location.exists()
        """Whether this job made the dataset's directory (a failed job then removes it)."""
        if lease:
            begin_job(self.location, self.job_id)

    def for_job(self, job_id: str) -> WriteJob:
        """The same planned write as job ``job_id``, whose lease its caller holds; it
        never removes the dataset's directory (earlier jobs of its caller wrote there)."""
        job = copy.copy(self)
        job.job_id, job.created = job_id, False
        return job

    def partition(self, task_id: int, attempt_id: int) -> PartitionWriter:
        """The writer of one task attempt (in the task's process)."""
        return PartitionWriter(self, task_id, attempt_id)

    def live(self) -> bool:
        """Whether the job still takes shards (not committed nor aborted): a task that
        runs again after the commit (a lost partition computed anew) writes none."""
        return self.location.has(lease_name(self.job_id))

    def write_partition(
        self, batches: Iterator[pa.RecordBatch], task_id: int, attempt_id: int
    ) -> TaskResult:
        """Write one partition; on any error this attempt's files are deleted and it
        re-raises."""
        writer = self.partition(task_id, attempt_id)
        try:
            for batch in batches:
                writer.add(batch)
            return writer.finish()
        except BaseException:
            writer.discard()
            raise

    def commit(self, results: list[TaskResult]):
        """Publish what the tasks wrote (the manifest last); on failure the job is
        aborted. Returns the manifest."""
        try:
            return commit_dataset(
                self.location,
                self.job_id,
                results,
                self.template(),
                overwrite=self.overwrite,
                generate_index=self.options.generate_index,
                unique_keys=self.options.mode == "kv",
                keep_previous_generation=self.options.keep_previous_generation,
            )
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """Delete every file of the job; the dataset stays as it was."""
        abort_dataset(self.location, self.job_id)
        if self.created:
            self.location.remove_if_empty()

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
        check_append(previous, self.template(), known, where)

    def template(self) -> Manifest:
        """The manifest's settings (mode, batch size, key settings, metadata)."""
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
