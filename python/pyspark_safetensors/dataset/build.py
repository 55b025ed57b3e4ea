"""Datasets written outside Spark (in-memory arrays, conversions, fixtures), under the
Spark writer's own commit: shards are written once under final-style names of a leased
job, then ``commit_dataset`` checks them, writes the tensor index and publishes the
manifest in one atomic put; a failure runs ``abort_dataset`` and leaves the dataset as it
was. There is no second protocol: only the tasks are replaced by this process (or by
worker processes calling ``stage_shard``).

    with DatasetBuilder("acts", batch_size=1024) as build:
        build.add_batch({"activation": x[:1024], "sample_id": ids[:1024]})
        build.add_batch({"activation": x[1024:], "sample_id": ids[1024:]})
    manifest = build.manifest
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Mapping

import numpy as np

from ..format import dtype_of, write_shard
from ..format.errors import InvalidArgumentError
from .commit import StagedShard, TaskResult, abort_dataset, begin_job, commit_dataset, merge_schemas
from .index import index_rows
from .layout import attempt_uuid, check_kv_columns, kv_tensor_name, shard_name
from .location import DatasetLocation
from .manifest import ColumnSchema, Manifest


def stage_shard(
    location: DatasetLocation,
    name: str,
    part: int,
    tensors: Mapping[str, np.ndarray],
    samples_count: int,
    *,
    metadata: Mapping[str, str] | None = None,
    index: bool = True,
) -> StagedShard:
    """Write one shard of a build at ``location`` under ``name`` (from
    ``DatasetBuilder.shard_name``): its crc32c taken from the bytes as they are written,
    its index rows kept when ``index``. Runs in any process; hand the result to
    ``DatasetBuilder.add``."""
    import crc32c

    crc = [0]

    def checksum(data) -> None:
        crc[0] = crc32c.crc32c(data, crc[0])

    header = location.write_shard(
        name, lambda path: write_shard(path, tensors, metadata, on_bytes=checksum)
    )
    return StagedShard(
        task_id=0,
        shard_index=part,
        final_name=name,
        samples_count=samples_count,
        bytes=header.file_size,
        crc32c=f"{crc[0]:08x}",
        index=index_rows(name, header) if index else None,
    )


class DatasetBuilder:
    """One dataset write from this process, committed on a clean exit of the ``with``
    block (or by ``commit()``) and aborted on an exception (or by ``abort()``).

    ``mode`` is ``"batch"`` (``batch_size``: the rows of a full shard; a shorter one is
    allowed anywhere, as Spark's last batch of a partition is) or ``"kv"`` (``name_col``
    names the key, tensors are ``{key}{kv_separator}{column}``, keys unique across
    shards). ``overwrite`` replaces an existing dataset at the commit point (its files
    deleted after it); otherwise the shards are appended under ``check_append``'s rule.
    ``generate_index`` defaults to the Spark writer's (KV: true, batch: false).
    ``metadata`` goes to the manifest. Shards are numbered in the order they are added
    unless ``part`` is given (shards added from several threads), and the dataset's
    sample order follows the parts."""

    def __init__(
        self,
        location: DatasetLocation | str | os.PathLike,
        *,
        mode: str = "batch",
        batch_size: int | None = None,
        name_col: str | None = None,
        kv_separator: str = "__",
        metadata: Mapping[str, str] | None = None,
        overwrite: bool = False,
        generate_index: bool | None = None,
    ):
        if mode not in ("batch", "kv"):
            raise InvalidArgumentError(f"mode {mode!r}: choose 'batch' or 'kv'")
        if (mode == "batch") != (batch_size is not None) or (mode == "kv") != (
            name_col is not None
        ):
            raise InvalidArgumentError(
                "a batch dataset needs batch_size (and no name_col), a KV dataset name_col "
                "(and no batch_size)"
            )
        self.location = DatasetLocation.of(location)
        self.template = Manifest(
            shards=(),
            schema={},
            mode=mode,
            batch_size=batch_size,
            name_col=name_col,
            kv_separator=kv_separator if mode == "kv" else None,
            metadata=dict(metadata or {}),
        )
        self.overwrite = overwrite
        self.generate_index = mode == "kv" if generate_index is None else generate_index
        self.job_id = uuid.uuid4().hex
        self.manifest: Manifest | None = None
        self._staged: list[StagedShard] = []
        self._schemas: list[dict[str, ColumnSchema]] = []
        self._lock = threading.Lock()
        self._next = 0
        self._created = not self.location.exists()
        begin_job(self.location, self.job_id)

    # -- naming and adding shards

    def shard_name(self, part: int) -> str:
        """The final-style name of shard ``part`` (new for every build)."""
        return shard_name(0, part, attempt_uuid(self.job_id))

    def add(self, staged: StagedShard, schema: Mapping[str, ColumnSchema]) -> None:
        """Take a shard ``stage_shard`` wrote (here or in a worker process)."""
        with self._lock:
            self._staged.append(staged)
            self._schemas.append(dict(schema))

    def _part(self, part: int | None) -> int:
        with self._lock:
            if part is None:
                part = self._next
            self._next = max(self._next, part + 1)
            return part

    def add_batch(
        self,
        columns: Mapping[str, np.ndarray],
        *,
        part: int | None = None,
        shard_metadata: Mapping[str, str] | None = None,
    ) -> StagedShard:
        """Write one batch-mode shard: ``columns`` share their first dimension (the rows),
        stored with their own dtypes."""
        rows = {name: len(a) for name, a in columns.items()}
        if not columns or len(set(rows.values())) != 1:
            raise InvalidArgumentError(
                f"a batch shard needs columns sharing their number of rows: {rows}"
            )
        n = next(iter(rows.values()))
        if self.template.batch_size is not None and n > self.template.batch_size:
            raise InvalidArgumentError(
                f"a batch shard of {n} rows exceeds batch_size {self.template.batch_size}"
            )
        schema = {
            name: ColumnSchema(dtype_of(a).name, tuple(a.shape), tuple(a.shape[1:]))
            for name, a in columns.items()
        }
        return self._write(part, columns, n, schema, shard_metadata)

    def add_kv(
        self,
        samples: Mapping[str, Mapping[str, np.ndarray]],
        *,
        part: int | None = None,
        shard_metadata: Mapping[str, str] | None = None,
    ) -> StagedShard:
        """Write one KV shard: ``{key: {column: array}}``, each array one tensor named by
        the dataset's tensor-name rule (``layout.kv_tensor_name``)."""
        sep = self.template.kv_separator
        tensors, schemas, checked = {}, [], set()
        for key, columns in samples.items():
            names = tuple(columns)
            if names not in checked:  # once per column set: the check is quadratic
                check_kv_columns(list(names), sep)
                checked.add(names)
            for column, a in columns.items():
                tensors[kv_tensor_name(key, column, sep)] = a
            schemas.append(
                {c: ColumnSchema(dtype_of(a).name, a.shape, a.shape) for c, a in columns.items()}
            )
        schema = merge_schemas(schemas, f"dataset {self.location.uri!r}", varying=True)
        return self._write(part, tensors, len(samples), schema, shard_metadata)

    def _write(self, part, tensors, samples_count, schema, shard_metadata) -> StagedShard:
        part = self._part(part)
        staged = stage_shard(
            self.location,
            self.shard_name(part),
            part,
            tensors,
            samples_count,
            metadata=shard_metadata,
            index=self.generate_index or self.template.mode == "kv",
        )
        self.add(staged, schema)
        return staged

    # -- ending the build

    def commit(self) -> Manifest:
        """Publish every shard added as the dataset (``commit_dataset``); returns the
        manifest. On failure the build is aborted."""
        where = f"dataset {self.location.uri!r}"
        try:
            schema = merge_schemas(self._schemas, where, varying=self.template.mode == "kv")
            result = TaskResult(0, tuple(self._staged), schema)
            self.manifest = commit_dataset(
                self.location,
                self.job_id,
                [result],
                self.template,
                overwrite=self.overwrite,
                generate_index=self.generate_index,
                unique_keys=self.template.mode == "kv",
            )
        except BaseException:
            self.abort()
            raise
        return self.manifest

    def abort(self) -> None:
        """Delete every shard of this build and its lease; the dataset stays as it was
        (and a directory this build created goes when empty)."""
        abort_dataset(self.location, self.job_id)
        if self._created:
            self.location.remove_if_empty()

    def __enter__(self) -> DatasetBuilder:
        return self

    def __exit__(self, kind, error, trace) -> None:
        if kind is None:
            self.commit()
        else:
            self.abort()
