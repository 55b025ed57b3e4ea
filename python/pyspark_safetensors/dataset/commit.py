"""The transactional commit protocol of a dataset write.

Tasks write shards under ``{root}/_temporary/{job_id}/attempt-{attempt}/`` and report
them in a ``TaskResult``. The driver's ``commit_dataset`` checks everything first, then
moves exactly the reported files into place, writes the index, writes the manifest last
(the commit point), removes what an overwrite replaced, and deletes the staging
directory with whatever failed or losing speculative attempts left there. ``abort_dataset``
deletes the staging directory. A reader never sees a shard that is not in the manifest.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from .index import read_index, write_index
from .layout import INDEX, MANIFEST, STAGING, SUCCESS
from .manifest import (
    ColumnSchema,
    Manifest,
    ManifestError,
    ShardEntry,
    load_manifest,
    write_manifest,
)


@dataclass(frozen=True)
class StagedShard:
    """One shard a task wrote to its staging directory."""

    task_id: int
    shard_index: int
    staged_path: str
    final_name: str
    samples_count: int
    bytes: int
    crc32c: str | None
    """Hex crc32c of the file, or None when checksums are off."""
    index: pa.Table | None
    """Index rows (``INDEX_SCHEMA``) with ``file_name`` = ``final_name``, if kept."""


@dataclass(frozen=True)
class TaskResult:
    """What one successful task attempt wrote."""

    attempt_id: int
    shards: tuple[StagedShard, ...]
    schema: dict[str, ColumnSchema]


def staging_dir(root: Path, job_id: str) -> Path:
    return root / STAGING / job_id


def attempt_dir(root: Path, job_id: str, attempt_id: int) -> Path:
    return staging_dir(root, job_id) / f"attempt-{attempt_id}"


def merge_schemas(
    schemas: list[dict[str, ColumnSchema]], where: str, *, varying: bool = False
) -> dict[str, ColumnSchema]:
    """One schema for all tasks; dtype and per-sample shape must agree per column.

    With ``varying`` (KV mode: each row is its own tensor) dimensions that differ are
    recorded as -1; dtype and rank must still agree.
    """
    merged: dict[str, ColumnSchema] = {}
    for schema in schemas:
        for name, col in schema.items():
            seen = merged.setdefault(name, col)
            if (seen.dtype, seen.sample_shape) == (col.dtype, col.sample_shape):
                continue
            if (
                varying
                and seen.dtype == col.dtype
                and len(seen.sample_shape) == len(col.sample_shape)
            ):
                dims = tuple(
                    a if a == b else -1
                    for a, b in zip(seen.sample_shape, col.sample_shape, strict=False)
                )
                merged[name] = ColumnSchema(col.dtype, dims, dims)
            else:
                raise ValueError(
                    f"{where}: column {name!r} is {seen.dtype}{list(seen.sample_shape)} in one part and "
                    f"{col.dtype}{list(col.sample_shape)} in another; every row must have the same shape and dtype"
                )
    return merged


def _find_duplicate_keys(index_tables: list[pa.Table]) -> list[str]:
    if not index_tables:
        return []
    keys = pa.concat_tables(index_tables).column("tensor_key")
    counts = keys.value_counts()
    dup = counts.filter(pc.greater(counts.field("counts"), 1))
    return [str(v) for v in dup.field("values").to_pylist()[:5]]


def commit_dataset(
    root: Path,
    job_id: str,
    results: list[TaskResult],
    template: Manifest,
    *,
    overwrite: bool,
    generate_index: bool,
    unique_keys: bool,
) -> Manifest:
    """Publish the shards of ``results`` as the dataset at ``root``.

    ``template`` carries mode, batch size, key settings and metadata; its shards and
    schema are filled in here. With ``overwrite`` the previous dataset is replaced at the
    commit point; otherwise (append) its shards are kept and the schemas must agree.
    ``unique_keys`` (KV mode) refuses a tensor key that appears in two shards.
    """
    where = f"dataset {str(root)!r}"
    staged = sorted(
        (s for r in results for s in r.shards), key=lambda s: (s.task_id, s.shard_index)
    )
    varying = template.mode == "kv"
    schema = merge_schemas([r.schema for r in results], where, varying=varying)
    new_index = [s.index for s in staged if s.index is not None]

    previous = None
    if (root / MANIFEST).exists():
        try:
            previous = load_manifest(root)
        except ManifestError:
            if not overwrite:
                raise
    kept: tuple[ShardEntry, ...] = ()
    kept_index: list[pa.Table] = []
    if previous is not None and not overwrite:
        if previous.mode != template.mode:
            raise ValueError(
                f"{where}: cannot append {template.mode}-mode data to a {previous.mode}-mode dataset"
            )
        # Compare the column sets before merging: a merged schema would hide a missing column.
        if previous.shards and staged and schema.keys() != previous.schema.keys():
            raise ValueError(
                f"{where}: appended columns {sorted(schema)} differ from the dataset's {sorted(previous.schema)}"
            )
        schema = merge_schemas([previous.schema, schema], f"{where} (append)", varying=varying)
        kept = previous.shards
        if generate_index or unique_keys:
            kept_index = [read_index(root)] if (root / INDEX).exists() else []
    if unique_keys:
        dups = _find_duplicate_keys(kept_index + new_index)
        if dups:
            raise ValueError(
                f"{where}: duplicate tensor keys across shards: {', '.join(map(repr, dups))} (keys must be unique in a KV dataset)"
            )

    moved: list[Path] = []
    try:
        for s in staged:
            target = root / s.final_name
            os.replace(s.staged_path, target)
            moved.append(target)
        entries = list(kept)
        first = sum(e.samples_count for e in kept)
        for s in staged:
            entries.append(ShardEntry(s.final_name, s.samples_count, s.bytes, first, s.crc32c))
            first += s.samples_count
        if kept and kept[0].first_sample is None:  # a dataset from another writer: number it now
            entries = _renumber(entries)
        if generate_index:
            write_index(root, kept_index + new_index)
        manifest = replace(
            template,
            shards=tuple(entries),
            schema=_full_shapes(schema, template.batch_size),
            index_file=INDEX if generate_index else None,
            created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        )
        write_manifest(root, manifest)  # the commit point
    except BaseException:
        for path in moved:
            path.unlink(missing_ok=True)
        raise

    if previous is not None and overwrite:
        current = {e.shard_path for e in manifest.shards}
        for old in previous.shards:
            if old.shard_path not in current:
                (root / old.shard_path).unlink(missing_ok=True)
    if not generate_index and (overwrite or previous is None):
        (root / INDEX).unlink(missing_ok=True)
    (root / SUCCESS).write_bytes(b"")
    abort_dataset(root, job_id)
    return manifest


def _renumber(entries: list[ShardEntry]) -> list[ShardEntry]:
    out, first = [], 0
    for e in entries:
        out.append(replace(e, first_sample=first))
        first += e.samples_count
    return out


def _full_shapes(
    schema: dict[str, ColumnSchema], batch_size: int | None
) -> dict[str, ColumnSchema]:
    if batch_size is None:
        return schema
    return {n: replace(c, shape=(batch_size, *c.sample_shape)) for n, c in schema.items()}


def abort_dataset(root: Path, job_id: str) -> None:
    """Delete everything the job staged (all attempts); leave published files alone."""
    shutil.rmtree(staging_dir(root, job_id), ignore_errors=True)
    with contextlib.suppress(OSError):  # other jobs are staging here, or it is already gone
        (root / STAGING).rmdir()
