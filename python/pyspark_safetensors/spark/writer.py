"""The tasks' side of a write: Arrow batches in, shards in the attempt's staging directory
out, one ``TaskCommit`` back to the driver."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
from pyspark.sql.datasource import WriterCommitMessage

from .. import __version__
from ..dataset import (
    FORMAT_VERSION,
    ColumnSchema,
    StagedShard,
    TaskResult,
    attempt_dir,
    index_rows,
    merge_schemas,
    shard_name,
)
from ..format import ChunkedTensor, dtype_of, write_shard
from .columns import ColumnError, ColumnPlan, decode_batch_column, decode_kv_column
from .options import WriterOptions


@dataclass
class TaskCommit(WriterCommitMessage):
    """The commit message of one task attempt."""

    result: TaskResult


class _ShardSink:
    """Writes shards for one task attempt and remembers what it wrote."""

    def __init__(
        self,
        options: WriterOptions,
        root: Path,
        job_id: str,
        task_id: int,
        attempt_id: int,
        file_uuid: str,
    ):
        self.options = options
        self.task_id = task_id
        self.attempt_id = attempt_id
        self.file_uuid = file_uuid
        self.dir = attempt_dir(root, job_id, attempt_id)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.shards: list[StagedShard] = []
        self.schema: dict[str, ColumnSchema] = {}
        self.metadata = {
            "format": "pt",
            "format_version": FORMAT_VERSION,
            "writer": f"pyspark-safetensors {__version__}",
            **options.metadata,
        }

    def write(self, tensors: dict, samples: int) -> None:
        name = shard_name(self.task_id, len(self.shards), self.file_uuid)
        path = self.dir / name
        crc = 0
        if self.options.checksum == "crc32c":
            import crc32c

            def on_bytes(data):
                nonlocal crc
                crc = crc32c.crc32c(data, crc)
        else:
            on_bytes = None
        header = write_shard(path, tensors, self.metadata, on_bytes=on_bytes)
        self.shards.append(
            StagedShard(
                task_id=self.task_id,
                shard_index=len(self.shards),
                staged_path=str(path),
                final_name=name,
                samples_count=samples,
                bytes=header.file_size,
                crc32c=f"{crc:08x}" if self.options.checksum == "crc32c" else None,
                index=index_rows(name, header)
                if self.options.generate_index or self.options.mode == "kv"
                else {},
            )
        )

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
        return TaskResult(self.attempt_id, tuple(self.shards), self.schema)

    def discard(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


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


class KVModeWriter:
    """One tensor per row and non-key column, keyed ``{key}{sep}{column}``; shards roll
    over at ``target_shard_size_mb``."""

    def __init__(self, options: WriterOptions, plans: list[ColumnPlan], sink: _ShardSink):
        self.options = options
        self.plans = plans
        self.sink = sink
        self.limit = options.target_shard_size_mb * 1_000_000
        self.current: dict[str, dict[str, np.ndarray]] = {}
        self.current_bytes = 0

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
        for p in self.plans:
            for tensor in {(t.shape, t.dtype): t for t in columns[p.name]}.values():
                self.sink.note_schema(p.name, dtype_of(tensor).name, tensor.shape)
        sep = self.options.kv_separator
        suffixes = [(f"{sep}{p.name}", columns[p.name]) for p in self.plans]
        sizes = np.sum([[t.nbytes for t in columns[p.name]] for p in self.plans], axis=0)
        for i, key in enumerate(keys):
            row = {key + suffix: tensors[i] for suffix, tensors in suffixes}
            size = int(sizes[i])
            if key in self.current:
                if self.options.duplicates_strategy == "fail":
                    raise ColumnError(
                        f"duplicate key {key!r} in column {self.options.name_col!r} (duplicatesStrategy=fail; use lastWin to keep the last row)"
                    )
                self.current_bytes -= sum(t.nbytes for t in self.current.pop(key).values())
            elif self.current and self.current_bytes + size > self.limit:
                self._seal()
            self.current[key] = row
            self.current_bytes += size

    def _seal(self) -> None:
        tensors = {name: t for row in self.current.values() for name, t in row.items()}
        self.sink.write(tensors, len(self.current))
        self.current, self.current_bytes = {}, 0

    def finish(self) -> None:
        if self.current:
            self._seal()


def write_partition(
    options: WriterOptions,
    plans: list[ColumnPlan],
    root: Path,
    job_id: str,
    batches: Iterator[pa.RecordBatch],
    task_id: int,
    attempt_id: int,
    file_uuid: str,
) -> TaskCommit:
    """Write one partition; on any error this attempt's files are deleted and it re-raises."""
    sink = _ShardSink(options, root, job_id, task_id, attempt_id, file_uuid)
    mode = KVModeWriter if options.mode == "kv" else BatchModeWriter
    writer = mode(options, plans, sink)
    try:
        for batch in batches:
            writer.add(batch)
        writer.finish()
    except BaseException:
        sink.discard()
        raise
    return TaskCommit(sink.result())
