"""Structured Streaming on the Python source: the sink, where each micro-batch is one
append of the dataset committed exactly once by its batch id, and the source, whose
micro-batches are the rows of the commits that landed since the last one.

The sink: Spark plans ``streamWriter()`` once when a query starts and pickles it into
every micro-batch's tasks; each ``commit``/``abort`` runs on a writer made anew. No call
tells a Python stream writer its query, so the tasks read the query id and batch id from
their local properties (``compat.stream_task_ids``) and send them back with their shards.
A batch's job id follows from (stream id, batch id), so a batch replayed after a restart
writes under the tag of the run it replays, and ``dataset.commit_dataset`` publishes
nothing for a batch the manifest's ``stream_commits`` already records.

The source: an offset is a position in the dataset's shard list, which appends only
extend (``{"shards": n, "last": name of shard n - 1}``); a micro-batch reads the shards
between two offsets through the batch reader (``reader.SafetensorsReader``) with its
views and options. Only manifest-listed shards are read, never a shard being written.
Options ``maxFilesPerTrigger`` (shards) and ``maxRowsPerTrigger`` (rows, in whole shards,
at least one) cap a micro-batch through Spark's ``ReadLimit`` (Spark 4.2 and newer, where
Python sources have admission control; refused on older lines).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace

import pyarrow as pa
from pyspark.sql.datasource import DataSourceStreamReader, InputPartition, WriterCommitMessage
from pyspark.sql.types import StructType

from ..dataset import (
    MANIFEST,
    ConcurrentCommitError,
    DatasetLocation,
    Manifest,
    StreamBatch,
    TaskResult,
    abort_dataset,
    begin_stream_batch,
    check_stream_checkpoint,
    commit_dataset,
    load_manifest,
    republish,
)
from ..format.errors import PysparkSafetensorsError
from .compat import stream_task_ids
from .options import OptionError
from .reader import ReadPlan, SafetensorsReader, Source
from .writer import WriteJob

try:  # Spark 4.2 and newer: admission control of Python stream readers
    from pyspark.sql.streaming.datasource import (
        ReadAllAvailable,
        ReadMaxFiles,
        ReadMaxRows,
        SupportsTriggerAvailableNow,
    )

    _AVAILABLE_NOW: tuple[type, ...] = (SupportsTriggerAvailableNow,)
except ImportError:
    ReadAllAvailable = ReadMaxFiles = ReadMaxRows = None
    _AVAILABLE_NOW = ()

try:  # Spark 4.1 and newer hand a stream writer Arrow batches
    from pyspark.sql.datasource import DataSourceStreamArrowWriter as _StreamWriter

    ARROW_STREAM_WRITER = True
except ImportError:  # Spark 4.0: rows
    from pyspark.sql.datasource import DataSourceStreamWriter as _StreamWriter

    ARROW_STREAM_WRITER = False

STREAM_ID_OPTION = "stream_id"
"""The sink's option naming its stream instead of the query's id."""

CHECKPOINT_OPTION = "checkpointLocation"
"""The query's checkpoint, which Spark hands the sink too: recorded with the stream's
batches, so that a stream id is refused under another checkpoint."""

STREAM_ONLY_OPTIONS = (STREAM_ID_OPTION, CHECKPOINT_OPTION)
"""Options a streaming write takes besides the batch writer's."""

PARTITION_COLUMNS_OPTION = "partition_columns"
"""The JVM sink's option of partition columns: refused here with a pointer to it."""

COMMIT_ATTEMPTS = 5
"""How often a micro-batch's commit is tried when another writer's commit landed while it
committed (two streams into one dataset): its shards stay staged between tries."""

ROWS_PER_ARROW_BATCH = 4096
"""Spark 4.0's stream writer gets rows: they are handed on in Arrow batches of this many."""


class StreamError(PysparkSafetensorsError, ValueError):
    """A streaming query the source cannot run: an output mode other than append, a
    stream over something that is not a dataset, a dataset rewritten under a stream."""


def split_stream_options(
    options: Mapping[str, str],
) -> tuple[str | None, str | None, dict[str, str]]:
    """(the ``stream_id`` option, the checkpoint location as ``checkpoint_key`` gives it,
    the other options)."""
    stream_only = {name.lower() for name in STREAM_ONLY_OPTIONS}
    rest = {k: v for k, v in options.items() if k.lower() not in stream_only}
    given = {k.lower(): v for k, v in options.items() if k.lower() in stream_only}
    stream_id = given.get(STREAM_ID_OPTION)
    if stream_id is not None and not stream_id.strip():
        raise OptionError(f"option {STREAM_ID_OPTION} is empty")
    checkpoint = given.get(CHECKPOINT_OPTION.lower())
    return stream_id, checkpoint_key(checkpoint) if checkpoint else None, rest


def checkpoint_key(location: str) -> str:
    """A checkpoint location as the manifest records it (the JVM sink's rule too): a path
    without a scheme made absolute, ``file:`` for a local one, no trailing slash."""
    import posixpath
    from urllib.parse import urlsplit

    scheme = urlsplit(location).scheme
    if len(scheme) > 1 and scheme != "file":
        return location.rstrip("/")
    path = location[len("file:") :] if scheme == "file" else location
    path = "/" + path.lstrip("/") if scheme == "file" else os.path.abspath(path)
    return "file:" + posixpath.normpath(path)


def refuse_complete_mode(overwrite: bool) -> None:
    """Spark asks for an overwrite of every micro-batch in ``complete`` output mode (and
    refuses ``update`` itself: the source declares no update support)."""
    if overwrite:
        raise StreamError(
            "the safetensors sink takes output mode 'append' only: each micro-batch is an "
            "append of the dataset. 'complete' (and 'update') rewrite results that a "
            "dataset of tensors keeps once; write the aggregate with foreachBatch and "
            ".write.mode('overwrite'), or stream in append mode"
        )


@dataclass
class BatchCommit(WriterCommitMessage):
    """What one task attempt of a micro-batch wrote, with the ids it read."""

    stream_id: str
    batch_id: int
    result: TaskResult | None
    """None: the dataset already held the batch (a replay), nothing was written."""


class SafetensorsStreamWriter(_StreamWriter):
    """The sink: every micro-batch one append of the dataset, the batch writer's options
    and modes, exactly once across restarts by the batch id."""

    def __init__(self, job: WriteJob, stream_id: str | None, schema: StructType,
                 checkpoint: str | None = None):  # fmt: skip
        self.job = job
        self.stream_id = stream_id
        self.checkpoint = checkpoint
        self.schema = schema

    def write(self, iterator) -> WriterCommitMessage:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        batch = self._batch(*stream_task_ids(ctx))
        if not begin_stream_batch(self.job.location, batch):
            return BatchCommit(batch.stream_id, batch.batch_id, None)
        batches = iterator if ARROW_STREAM_WRITER else _arrow_batches(iterator, self.schema)
        job = self.job.for_job(batch.job_id)
        result = job.write_partition(batches, ctx.partitionId(), ctx.taskAttemptId())
        return BatchCommit(batch.stream_id, batch.batch_id, result)

    def _batch(self, query_id: str | None, batch_id: int | None) -> StreamBatch:
        stream_id = self.stream_id or query_id
        if stream_id is None or batch_id is None:
            raise StreamError(
                "this task runs no streaming micro-batch Spark describes (no query or batch "
                f"id among its local properties); set option {STREAM_ID_OPTION}, or report "
                "the Spark version"
            )
        return StreamBatch(stream_id, batch_id, self.checkpoint)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        batch = self._committed_batch(messages, batchId)
        if batch is None:
            return  # no task ran: nothing was written, nothing to record
        results = [m.result for m in messages if isinstance(m, BatchCommit) and m.result]
        commit_stream_batch(self.job, batch, results)

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """The batch's files and lease deleted, also when none of its tasks succeeded (no
        message names the stream: it is the ``stream_id`` option or the query's id, which
        the checkpoint keeps); a stream that never restarts leaves nothing behind."""
        batch = self._committed_batch(messages, batchId)
        stream_id = batch.stream_id if batch is not None else self.stream_id or self._query_id()
        if stream_id is not None:
            abort_dataset(self.job.location, StreamBatch(stream_id, batchId).job_id)
        # else the stream cannot be named: the batch's replay reclaims what its tasks left

    def _query_id(self) -> str | None:
        """The query's id, from its checkpoint's ``metadata`` file (Spark writes it first)."""
        import json

        if self.checkpoint is None:
            return None
        try:
            return json.loads(DatasetLocation.of(self.checkpoint).read_bytes("metadata"))["id"]
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _committed_batch(self, messages, batch_id: int) -> StreamBatch | None:
        streams = {m.stream_id for m in messages if isinstance(m, BatchCommit)}
        batches = {m.batch_id for m in messages if isinstance(m, BatchCommit)}
        if not streams:
            return None
        if len(streams) > 1 or batches != {batch_id}:
            raise StreamError(
                f"micro-batch {batch_id}: its tasks saw streams {sorted(streams)} and batches "
                f"{sorted(batches)}; nothing was committed"
            )
        return StreamBatch(streams.pop(), batch_id, self.checkpoint)


def commit_stream_batch(
    job: WriteJob, batch: StreamBatch, results: list[TaskResult]
) -> Manifest | None:
    """Publish one micro-batch (nothing when the dataset records it already), retrying
    when another commit landed meanwhile; on failure the batch's files are deleted. A
    batch that wrote no shard publishes no commit (as the JVM sink): its lease goes."""
    if not any(r.shards for r in results):
        abort_dataset(job.location, batch.job_id)
        current = load_manifest(job.location) if job.location.is_file(MANIFEST) else None
        if batch.committed_in(current):  # a replay: its commit may have died before these
            republish(job.location, current)
        return None
    for attempt in range(COMMIT_ATTEMPTS):
        try:
            return commit_dataset(
                job.location,
                batch.job_id,
                results,
                job.template(),
                overwrite=False,
                generate_index=job.options.generate_index,
                unique_keys=job.options.mode == "kv",
                stream=batch,
            )
        except ConcurrentCommitError:
            if attempt == COMMIT_ATTEMPTS - 1:
                abort_dataset(job.location, batch.job_id)
                raise
            time.sleep(0.05 * (attempt + 1))
        except BaseException:
            abort_dataset(job.location, batch.job_id)
            raise
    return None


def _arrow_batches(rows: Iterator, schema: StructType) -> Iterator[pa.RecordBatch]:
    """Spark 4.0's rows as Arrow batches of the query's schema."""
    from pyspark.sql.pandas.types import to_arrow_schema

    arrow_schema = to_arrow_schema(schema)
    chunk = []
    for row in rows:
        chunk.append(row.asDict(recursive=True))
        if len(chunk) == ROWS_PER_ARROW_BATCH:
            yield pa.RecordBatch.from_pylist(chunk, schema=arrow_schema)
            chunk = []
    if chunk:
        yield pa.RecordBatch.from_pylist(chunk, schema=arrow_schema)


def stream_writer(
    options: Mapping[str, str], schema: StructType, overwrite: bool
) -> SafetensorsStreamWriter:
    """The sink of a streaming query, planned on the driver: options parsed, columns
    planned and the append checked (a complete dataset refused) before any batch runs."""
    from ..dataset import split_storage_options
    from .options import WriterOptions

    refuse_complete_mode(overwrite)
    if any(k.lower() == PARTITION_COLUMNS_OPTION for k in options):
        raise StreamError(
            f"option {PARTITION_COLUMNS_OPTION}: partitioned writes are the JVM source's (its "
            "sink takes the option: .option('implementation', 'jvm')); the Python source "
            "writes one dataset"
        )
    stream_id, checkpoint, rest = split_stream_options(options)
    storage, writer_options = split_storage_options(rest)
    job = WriteJob(WriterOptions.parse(writer_options), schema, False, storage, lease=False)
    if stream_id is not None and job.location.is_file(MANIFEST):
        # the query's own id is new with each checkpoint: only a given stream id can meet
        # another checkpoint's batches
        try:
            check_stream_checkpoint(load_manifest(job.location), stream_id, checkpoint,
                                    f"dataset {job.location.uri!r}")  # fmt: skip
        except PysparkSafetensorsError as e:
            raise StreamError(str(e)) from None
    return SafetensorsStreamWriter(job, stream_id, schema, checkpoint)


# ------------------------------------------------------------------ the source


@dataclass(frozen=True)
class StreamPartition(InputPartition):
    """One partition of a micro-batch: the batch reader's partition over ``source``, the
    dataset cut to the micro-batch's shards."""

    source: Source
    part: InputPartition


class SafetensorsStreamReader(DataSourceStreamReader, *_AVAILABLE_NOW):
    """The rows of each commit that lands on a dataset, from its first commit on, in the
    view the batch reader would give (``rows``, ``kv``, ``index``, ``tensors``,
    ``files``)."""

    def __init__(self, plan: ReadPlan, schema: StructType):
        if len(plan.sources) != 1 or plan.sources[0].manifest is None:
            raise StreamError(
                f"{plan.options.path!r}: a stream reads one dataset (a directory with a "
                f"{MANIFEST}), following its commits; loose files and several paths are read "
                "with spark.read"
            )
        self.location: DatasetLocation = plan.sources[0].location
        self.plan = plan
        self.schema = schema
        self._reader(plan.sources[0])  # a given schema is checked here, on the driver
        self._target: int | None = None  # the shards an availableNow query reads
        limited = plan.options.max_files_per_trigger or plan.options.max_rows_per_trigger
        if limited and ReadMaxFiles is None:
            import pyspark

            raise StreamError(
                f"maxFilesPerTrigger and maxRowsPerTrigger need Spark 4.2 or newer (admission "
                f"control of Python stream sources); this is Spark {pyspark.__version__}"
            )

    def initialOffset(self) -> dict:
        return {"shards": 0}

    def prepareForTriggerAvailableNow(self) -> None:
        """An availableNow query reads the shards listed now, in micro-batches of its
        limit (without this, Spark would read them in one batch, limit or not)."""
        self._target = len(load_manifest(self.location).shards)

    def getDefaultReadLimit(self):
        """The options' cap of a micro-batch (Spark 4.2+ asks before each)."""
        options = self.plan.options
        if options.max_files_per_trigger:
            return ReadMaxFiles(options.max_files_per_trigger)
        if options.max_rows_per_trigger:
            return ReadMaxRows(options.max_rows_per_trigger)
        return ReadAllAvailable()

    def latestOffset(self, start: dict | None = None, limit=None) -> dict:
        """Every new shard, or (Spark 4.2+, a ``ReadLimit``) as many as the limit takes
        from ``start``: shards up to ``max_files``, or whole shards up to ``max_rows`` rows,
        at least one."""
        manifest = load_manifest(self.location)
        end = (
            len(manifest.shards)
            if self._target is None
            else min(len(manifest.shards), self._target)
        )
        if start is not None and limit is not None and ReadMaxFiles is not None:
            first = self._check(manifest, start)
            if isinstance(limit, ReadMaxFiles):
                end = min(end, first + limit.max_files)
            elif isinstance(limit, ReadMaxRows):
                rows, stop = 0, first
                while stop < end and (stop == first or rows + manifest.shards[stop].samples_count
                                      <= limit.max_rows):  # fmt: skip
                    rows += manifest.shards[stop].samples_count
                    stop += 1
                end = stop
        return _offset(manifest, end)

    def partitions(self, start: dict, end: dict) -> list[StreamPartition]:
        manifest = load_manifest(self.location)
        first, stop = self._check(manifest, start), self._check(manifest, end)
        shards = manifest.shards[first:stop]
        cut = replace(manifest, shards=shards, index_file=None, index_crc32c=None)
        # index_file dropped: a later commit replaces it; KV shards read their own headers
        source = Source(
            self.location,
            cut,
            tuple(s.shard_path for s in shards),
            tuple(s.bytes for s in shards),
        )
        return [StreamPartition(source, part) for part in self._reader(source).partitions()]

    def read(self, partition: StreamPartition) -> Iterator[pa.RecordBatch]:
        yield from self._reader(partition.source).read(partition.part)

    def _reader(self, source: Source) -> SafetensorsReader:
        plan = self.plan
        return SafetensorsReader(plan.options, source, plan.view, self.schema, inferred=plan.schema)

    def _check(self, manifest: Manifest, offset: dict) -> int:
        """The shard position of ``offset``, checked against ``manifest``: the shards it
        counted must still be the dataset's first ones."""
        n = int(offset.get("shards", 0))
        if n > len(manifest.shards) or _offset(manifest, n) != offset:
            raise StreamError(
                f"dataset {self.location.uri!r} was overwritten or rewritten under this stream "
                f"(offset {offset}, the manifest lists {len(manifest.shards)} shards): a "
                "stream follows a dataset that appends only; start it anew with a fresh "
                "checkpoint"
            )
        return n

    def commit(self, end: dict) -> None:
        """Nothing to release: shards are read from the manifest, never consumed."""


def _offset(manifest: Manifest, n: int) -> dict:
    if n == 0:
        return {"shards": 0}
    return {"shards": n, "last": manifest.shards[n - 1].shard_path}
