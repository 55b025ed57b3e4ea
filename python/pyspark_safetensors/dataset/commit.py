"""The commit protocol of a dataset write, made for object stores (where a rename is a
copy of every byte).

1. The driver leases the job (``_temporary/{job}.job``) before any task runs.
2. Tasks write each shard once, at the dataset root, under a final-style name
   ``part-{task}-{shard}-{uuid}.safetensors`` whose uuid starts with the job's tag and is
   new for every attempt. No reader trusts a file the manifest does not list.
3. ``commit_dataset`` (driver) checks everything first, writes the tensor index under a
   name of its own (``_tensor_index-{commit}.parquet``, named in the manifest with its
   crc32c), then puts the manifest (one atomic put: the commit point) after checking
   that no other commit landed since it read the previous one. Nothing is moved or
   copied.
4. Right after the commit point it puts the same index bytes as ``_tensor_index.parquet``
   (the name the format spec gives, for tools that read the index without the
   manifest), or deletes a stale one when this commit has no index.
5. Then it reclaims what no manifest lists: its own failed and losing attempts, the
   leftovers of dead jobs (never a live job's) and, by default, the generation an
   overwrite replaced, so the directory holds only the files the new manifest names
   (plus ``_tensor_index.parquet`` and ``_SUCCESS``). With ``keep_previous_generation``
   that generation is kept until the next commit, so readers still on the old manifest
   can finish.
``abort_dataset`` deletes the job's own files and its lease. Both drop the lease before
they list, and a task checks the lease after its last shard landed: an attempt still
running when the job ends cleans up after itself.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import socket
import time
from dataclasses import dataclass, replace
from datetime import datetime, timezone

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..format.errors import InvalidArgumentError, PysparkSafetensorsError
from .index import INDEX_ROW_GROUP, INDEX_SCHEMA, read_index
from .layout import (
    INDEX,
    INDEX_NAME,
    INDEX_PART,
    JOB_LEASE_SUFFIX,
    MANIFEST,
    SHARD_NAME,
    STAGING,
    SUCCESS,
    index_name,
    job_of,
)
from .location import DatasetLocation
from .manifest import ColumnSchema, Manifest, ManifestError, ShardEntry, load_manifest

STALE_JOB_SECONDS = 24 * 3600
"""A job lease from another host older than this is taken as dead (its driver cannot be
asked); on the lease's own host a dead process is detected at once."""

LOCK = "_commit.lock"
_LOCK_WAIT_SECONDS = 30.0


class ConcurrentCommitError(PysparkSafetensorsError, RuntimeError):
    """Another write committed to the same dataset while this one was committing."""


@dataclass(frozen=True)
class StagedShard:
    """One shard a task attempt wrote, not yet listed by any manifest."""

    task_id: int
    shard_index: int
    final_name: str
    """The shard's name at the dataset root (written there directly)."""
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
                raise InvalidArgumentError(
                    f"{where}: column {name!r} is {seen.dtype}{list(seen.sample_shape)} in one part and "
                    f"{col.dtype}{list(col.sample_shape)} in another; every row must have the same shape and dtype"
                )
    return merged


class AppendError(PysparkSafetensorsError, ValueError):
    """Data that cannot be appended to a dataset: another mode, other columns, dtypes,
    sample shapes, batch size or key settings."""


class CompleteDatasetError(AppendError):
    """An append to a dataset its producer marked complete."""


@dataclass(frozen=True)
class StreamBatch:
    """The streaming micro-batch a commit publishes: ``batch_id`` of the stream
    ``stream_id`` (a streaming query's id, stable across restarts from its checkpoint),
    written from the query's ``checkpoint`` location when the sink was told it."""

    stream_id: str
    batch_id: int
    checkpoint: str | None = None

    def __post_init__(self):
        if not self.stream_id or self.batch_id < 0:
            raise InvalidArgumentError(
                f"a stream batch needs a stream id and a batch id >= 0, got {self!r}"
            )

    def committed_in(self, manifest: Manifest | None) -> bool:
        """Whether ``manifest`` already records this batch (or a later one) of the stream."""
        if manifest is None:
            return False
        return manifest.stream_commits.get(self.stream_id, -1) >= self.batch_id

    @property
    def job_id(self) -> str:
        """The write job of this batch, the same in every run of it: a replay after a crash
        names its shards with the job tag of the run it replays, so its commit (or the
        replay's clean-up) reclaims what the crashed run left."""
        digest = hashlib.sha256(f"{self.stream_id}\0{self.batch_id}".encode()).hexdigest()
        return digest[:32]


def begin_stream_batch(location: DatasetLocation, batch: StreamBatch) -> bool:
    """Lease ``batch``'s job from one of its tasks (a stream's driver has no hook before
    a micro-batch's tasks run); False, lease dropped, when the dataset already records
    the batch: a replayed batch writes nothing. The lease names no host, so every
    implementation ages it out after ``STALE_JOB_SECONDS`` if the stream never comes
    back; the batch's commit drops it. It is put before the manifest is read: a task
    racing the batch's commit then either sees the batch committed or finds its lease
    gone after its last shard, and deletes its shards."""
    name = lease_name(batch.job_id)
    lease = {"job_id": batch.job_id, "stream_id": batch.stream_id, "batch_id": batch.batch_id}
    location.makedirs()
    location.put_json(name, {**lease, "started": time.time()})
    if batch.committed_in(_previous_manifest(location, overwrite=False)):
        location.delete([name])
        return False
    return True


def check_append(
    previous: Manifest,
    template: Manifest,
    schema: dict[str, ColumnSchema] | None,
    where: str,
) -> dict[str, ColumnSchema]:
    """The schema of ``previous`` after appending data written with ``template``'s
    settings and columns ``schema`` (None: no new shards, only the settings are checked).

    The one rule of append compatibility: the Spark writer runs it on the driver before
    any task (with what the DataFrame's types tell), and the commit runs it again with
    what the tasks wrote (another write may have committed in between). An empty dataset
    takes any columns; dtypes and sample shapes follow ``merge_schemas``.
    """
    if previous.complete:
        raise CompleteDatasetError(
            f"{where} is marked complete (its producer declared it finished: 'complete' in "
            "its manifest); appends are refused: overwrite it, or write to another path"
        )
    if previous.mode != template.mode:
        raise AppendError(
            f"{where}: cannot append {template.mode}-mode data to a {previous.mode}-mode dataset"
        )
    if not previous.shards:
        return dict(schema or {})
    if previous.partition_columns != template.partition_columns:

        def by(columns):
            return f"partitioned by {list(columns)}" if columns else "not partitioned"

        advice = (
            f"append with partitionBy({', '.join(map(repr, previous.partition_columns))}) "
            "(the JVM source's)"
            if previous.partition_columns
            else "append without partitionBy"
        )
        raise AppendError(
            f"{where} is {by(previous.partition_columns)}, this write is "
            f"{by(template.partition_columns)}; {advice}, or overwrite the dataset"
        )
    settings = (
        ("batch_size", previous.batch_size, template.batch_size)
        if previous.mode == "batch"
        else ("name_col", previous.name_col, template.name_col),
    )
    if previous.mode == "kv":
        settings += (("kv_separator", previous.kv_separator, template.kv_separator),)
    for option, theirs, ours in settings:
        if theirs is not None and theirs != ours:
            raise AppendError(
                f"{where}: the dataset's {option} is {theirs!r}, this write's is {ours!r}; "
                f"append with {option}={theirs!r}, or overwrite the dataset"
            )
    if schema is None:
        return dict(previous.schema)
    # Compare the column sets before merging: a merged schema would hide a missing column.
    if schema.keys() != previous.schema.keys():
        missing = sorted(previous.schema.keys() - schema.keys())
        extra = sorted(schema.keys() - previous.schema.keys())
        detail = "; ".join(
            part
            for part in (
                f"missing {missing}" if missing else "",
                f"not in the dataset {extra}" if extra else "",
            )
            if part
        )
        raise AppendError(
            f"{where}: appended columns {sorted(schema)} differ from the dataset's "
            f"{sorted(previous.schema)} ({detail})"
        )
    try:
        return merge_schemas(
            [previous.schema, schema], f"{where} (append)", varying=previous.mode == "kv"
        )
    except ValueError as e:
        raise AppendError(str(e)) from None


def _find_duplicate_keys(index_tables: list[pa.Table]) -> list[str]:
    if not index_tables:
        return []
    keys = pa.concat_tables(index_tables).column("tensor_key")
    counts = keys.value_counts()
    dup = counts.filter(pc.greater(counts.field("counts"), 1))
    return [str(v) for v in dup.field("values").to_pylist()[:5]]


def _job_tag(job_id: str) -> str:
    return job_id[:16]


def lease_name(job_id: str) -> str:
    return f"{STAGING}/{job_id}{JOB_LEASE_SUFFIX}"


def begin_job(location: DatasetLocation, job_id: str) -> None:
    """Lease the job before its tasks run, so no other write reclaims its shards."""
    location.makedirs()
    location.put_json(
        lease_name(job_id),
        {
            "job_id": job_id,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": time.time(),
        },
    )


def _live_job_tags(location: DatasetLocation, listing, own: str | None) -> set[str]:
    tags = set()
    for name in listing:
        if not (name.startswith(STAGING + "/") and name.endswith(JOB_LEASE_SUFFIX)):
            continue
        job = name[len(STAGING) + 1 : -len(JOB_LEASE_SUFFIX)]
        if job == own:
            continue
        try:
            lease = json.loads(location.read_bytes(name))
        except (OSError, ValueError):
            continue  # half-written or vanished lease: its job is gone
        if _alive(lease):
            tags.add(_job_tag(job))
    return tags


def _alive(lease: dict) -> bool:
    if lease.get("host") == socket.gethostname():
        try:
            os.kill(int(lease["pid"]), 0)
        except ProcessLookupError:
            return False
        except (PermissionError, KeyError, TypeError, ValueError):
            return True
        return True
    started = lease.get("started")
    return isinstance(started, (int, float)) and time.time() - started < STALE_JOB_SECONDS


def reclaim(location: DatasetLocation, keep: set[str], *, own_job: str | None = None) -> list[str]:
    """Delete what no manifest trusts: unlisted shards and indexes (except ``keep``), and
    the leases and staging leftovers of dead jobs and of ``own_job``. Files of live jobs
    are left alone. Returns the names deleted."""
    listing = location.list(recursive=False)
    staging = (
        {f"{STAGING}/{n}": i for n, i in location.list_under(STAGING).items()}
        if STAGING in listing
        else {}
    )
    live = _live_job_tags(location, staging, own_job)
    doomed = []
    for name in listing:
        if name in keep:
            continue
        if SHARD_NAME.match(name):
            if job_of(name) not in live:
                doomed.append(name)
        elif INDEX_NAME.match(name):
            doomed.append(name)
    for name in staging:
        rest = name[len(STAGING) + 1 :]
        if "/" in rest:
            continue
        job = rest[: -len(JOB_LEASE_SUFFIX)] if rest.endswith(JOB_LEASE_SUFFIX) else rest
        if job == own_job or _job_tag(job) not in live:
            doomed.append(name)
    location.delete(doomed)
    if STAGING in listing and not set(staging) - set(doomed):
        location.delete([STAGING])
    return doomed


def _index_bytes(tables: list[pa.Table]) -> bytes:
    table = (
        pa.concat_tables([t.cast(INDEX_SCHEMA) for t in tables])
        if tables
        else INDEX_SCHEMA.empty_table()
    )
    sink = io.BytesIO()
    # Keys are unique: dictionary-encoding them only costs time.
    pq.write_table(
        table, sink, use_dictionary=["file_name", "dtype"], row_group_size=INDEX_ROW_GROUP
    )
    return sink.getvalue()


def commit_dataset(
    location: DatasetLocation,
    job_id: str,
    results: list[TaskResult],
    template: Manifest,
    *,
    overwrite: bool,
    generate_index: bool,
    unique_keys: bool,
    keep_previous_generation: bool = False,
    stream: StreamBatch | None = None,
) -> Manifest:
    """Publish the shards of ``results`` as the dataset at ``location``.

    ``template`` carries mode, batch size, key settings and metadata; its shards and
    schema are filled in here. With ``overwrite`` the previous dataset is replaced at the
    commit point and its files deleted right after it (``keep_previous_generation``: kept
    until the next commit, for readers still reading it); otherwise (append) its shards
    are kept and the schemas must agree. With ``generate_index`` the index covers every
    shard of the new manifest and is also put as ``_tensor_index.parquet``.
    ``unique_keys`` (KV mode) refuses a tensor key that appears in two shards. Raises
    ``ConcurrentCommitError`` when another commit landed while this one ran.

    ``stream``: the micro-batch this commit is, recorded in ``stream_commits``; when the
    dataset already records it (a replay after a crash) nothing is published, the
    batch's shards and lease are deleted and the current manifest is returned. Every
    commit carries ``stream_commits`` forward; an append to a complete dataset is refused.
    """
    location = DatasetLocation.of(location)
    where = f"dataset {location.uri!r}"
    staged = sorted(
        (s for r in results for s in r.shards), key=lambda s: (s.task_id, s.shard_index)
    )
    schema = merge_schemas([r.schema for r in results], where, varying=template.mode == "kv")
    new_index = [s.index for s in staged if s.index is not None]

    previous = _previous_manifest(location, overwrite)
    if stream is not None and stream.committed_in(previous):
        location.delete([s.final_name for s in staged])
        abort_dataset(location, job_id)
        republish(location, previous)
        return previous
    kept: tuple[ShardEntry, ...] = ()
    kept_index: list[pa.Table] = []
    if previous is not None and not overwrite:
        schema = check_append(previous, template, schema if staged else None, where)
        kept = previous.shards
        if (generate_index or unique_keys) and previous.index_file is not None:
            kept_index = [read_index(location, previous)]
    if unique_keys:
        _refuse_duplicate_keys(kept_index + new_index, where)

    commit_id = os.urandom(16).hex()
    index_data = _index_bytes(kept_index + new_index) if generate_index else None
    index_file, index_crc = (
        _put_index(location, commit_id, index_data) if index_data is not None else (None, None)
    )
    manifest = replace(
        template,
        shards=_shard_entries(kept, staged),
        schema=_full_shapes(schema, template.batch_size),
        index_file=index_file,
        index_crc32c=index_crc,
        commit_id=commit_id,
        parent_commit=previous.commit_id if previous is not None else None,
        created_at=_now(),
        stream_commits=_stream_commits(previous, stream),
        stream_checkpoints=_stream_checkpoints(previous, stream),
        complete=False,
    )
    try:
        _publish_manifest(location, manifest, previous)  # the commit point
    except BaseException:
        if index_file is not None:
            location.delete([index_file])
        raise
    _publish_spec_index(location, index_data)
    _clean_up(location, job_id, manifest, previous if keep_previous_generation else None)
    return manifest


def _refuse_duplicate_keys(indexes: list[pa.Table], where: str) -> None:
    """A KV dataset's keys are unique: refuse a tensor key two shards hold."""
    dups = _find_duplicate_keys(indexes)
    if dups:
        raise InvalidArgumentError(
            f"{where}: duplicate tensor keys across shards: {', '.join(map(repr, dups))} (keys must be unique in a KV dataset)"
        )


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _stream_checkpoints(previous: Manifest | None, stream: StreamBatch | None) -> dict[str, str]:
    """``previous``'s stream checkpoints, with ``stream``'s set to its checkpoint."""
    checkpoints = dict(previous.stream_checkpoints) if previous is not None else {}
    if stream is not None and stream.checkpoint:
        checkpoints[stream.stream_id] = stream.checkpoint
    return checkpoints


def check_stream_checkpoint(manifest: Manifest | None, stream_id: str, checkpoint: str | None,
                            where: str) -> None:  # fmt: skip
    """Refuse stream ``stream_id`` under ``checkpoint`` when the dataset records its batches
    from another checkpoint: under a new checkpoint Spark numbers the batches from 0 again,
    and every one would be taken for a replay of a committed batch and dropped."""
    if manifest is None or checkpoint is None or stream_id not in manifest.stream_commits:
        return
    recorded = manifest.stream_checkpoints.get(stream_id)
    if recorded is not None and recorded != checkpoint:
        raise InvalidArgumentError(
            f"{where}: stream {stream_id!r} committed its batches up to "
            f"{manifest.stream_commits[stream_id]} from checkpoint {recorded!r}; this query's "
            f"checkpoint is {checkpoint!r}, whose batch ids start again at 0, so every batch "
            "would be taken for a replay and dropped. Give this query another stream_id (or "
            f"none: the query's own id), or run it from checkpoint {recorded!r}"
        )


def republish(location: DatasetLocation, manifest: Manifest) -> None:
    """Put ``_tensor_index.parquet`` and ``_SUCCESS`` as ``manifest``'s commit leaves them:
    a replayed batch does it, since a crash between a commit's manifest and these names
    leaves them one commit behind."""
    data = location.read_bytes(manifest.index_file) if manifest.index_file else None
    _publish_spec_index(location, data)
    location.put_bytes(SUCCESS, b"")


def _stream_commits(previous: Manifest | None, stream: StreamBatch | None) -> dict[str, int]:
    """``previous``'s stream commits, with ``stream``'s entry set to its batch: an
    overwrite keeps them too, so a stream replaying a batch after it still commits
    nothing twice."""
    commits = dict(previous.stream_commits) if previous is not None else {}
    if stream is not None:
        commits[stream.stream_id] = stream.batch_id
    return commits


def mark_complete(location: DatasetLocation | str | os.PathLike) -> Manifest:
    """Declare the dataset at ``location`` finished: a commit with no new shards that sets
    ``complete`` (readers following the dataset stop; appends are refused from then on,
    an overwrite starts anew). Marking a complete dataset again changes nothing. Returns
    the manifest."""
    location = DatasetLocation.of(location)
    previous = _previous_manifest(location, overwrite=False)
    if previous is None:
        raise InvalidArgumentError(
            f"dataset {location.uri!r}: no {MANIFEST} to mark complete; write the dataset first"
        )
    if previous.complete:
        return previous
    manifest = replace(
        previous,
        complete=True,
        commit_id=os.urandom(16).hex(),
        parent_commit=previous.commit_id,
        created_at=_now(),
    )
    _publish_manifest(location, manifest, previous)
    return manifest


def _previous_manifest(location: DatasetLocation, overwrite: bool) -> Manifest | None:
    """The dataset's current manifest, if any; an unreadable one is an error for an
    append and replaced by an overwrite."""
    if not location.has(MANIFEST):
        return None
    try:
        return load_manifest(location)
    except ManifestError:
        if not overwrite:
            raise
        return None


def _shard_entries(
    kept: tuple[ShardEntry, ...], staged: list[StagedShard]
) -> tuple[ShardEntry, ...]:
    """The kept shards, then the new ones, each with its first global sample index."""
    entries = list(kept)
    first = sum(e.samples_count for e in kept)
    for s in staged:
        entries.append(ShardEntry(s.final_name, s.samples_count, s.bytes, first, s.crc32c))
        first += s.samples_count
    if kept and kept[0].first_sample is None:  # a dataset from another writer: number it now
        entries = _renumber(entries)
    return tuple(entries)


def _put_index(location: DatasetLocation, commit_id: str, data: bytes) -> tuple[str, str]:
    """Put this commit's tensor index; returns (its name, its hex crc32c)."""
    import crc32c

    name = index_name(commit_id)
    location.put_bytes(name, data)
    return name, f"{crc32c.crc32c(data):08x}"


def _publish_spec_index(location: DatasetLocation, data: bytes | None) -> None:
    """After the commit point: the directory ``_tensor_index.parquet/`` gets the committed
    index's bytes as its one part, or goes when this commit has none (an index of another
    generation would route readers to shards the manifest no longer lists). One file of
    that name, as earlier versions wrote it, gives way to the directory. A crash before
    this step leaves the per-commit index, which the manifest names, authoritative."""
    if data is None:
        location.delete([INDEX])
        return
    if location.is_file(INDEX):
        location.delete([INDEX])
    location.put_bytes(INDEX_PART, data)


def _clean_up(
    location: DatasetLocation, job_id: str, manifest: Manifest, previous: Manifest | None
) -> None:
    """After the commit point: drop the job's lease, reclaim what no manifest lists
    except ``previous`` (a replaced generation kept for its readers), and mark
    ``_SUCCESS``."""
    keep = {e.shard_path for e in manifest.shards} | {MANIFEST, LOCK}
    if manifest.index_file:
        keep |= {manifest.index_file, INDEX}
    location.delete([lease_name(job_id)])  # before the listing: see abort_dataset
    if previous is not None:
        keep |= {e.shard_path for e in previous.shards}
        if previous.index_file:
            keep.add(previous.index_file)
    reclaim(location, keep, own_job=job_id)
    location.put_bytes(SUCCESS, b"")


def _publish_manifest(
    location: DatasetLocation, manifest: Manifest, previous: Manifest | None
) -> None:
    """Put the manifest unless another commit landed since ``previous`` was read.

    Locally an exclusive lock file closes the window between the check and the put. Object
    stores offer no exclusive create through pyarrow: the check runs just before the put
    and the result is read back after it, so only two commits landing within the same
    request round trip go unnoticed (write to one path from one job at a time)."""
    base = previous.commit_id if previous is not None else None
    with _commit_lock(location):
        current = _current_commit(location)
        if current != (base, previous is not None):
            raise ConcurrentCommitError(
                f"dataset {location.uri!r}: another write committed while this one was committing "
                f"(expected commit {base}, found {current[0]}); nothing of this write was published, run it again"
            )
        location.put_json(MANIFEST, manifest.to_json())
    landed = load_manifest(location)
    if manifest.commit_id not in (landed.commit_id, landed.parent_commit):
        raise ConcurrentCommitError(
            f"dataset {location.uri!r}: another write replaced this commit ({manifest.commit_id}) as it landed; "
            "its shards may not be listed, run it again"
        )


def _current_commit(location: DatasetLocation) -> tuple[str | None, bool]:
    if not location.has(MANIFEST):
        return None, False
    try:
        return load_manifest(location).commit_id, True
    except ManifestError:
        return None, True


class _commit_lock:
    """An exclusive lock file on local storage (no-op elsewhere); a lock whose holder died
    on this host, or older than ``_LOCK_WAIT_SECONDS``, is broken."""

    def __init__(self, location: DatasetLocation):
        self.location = location
        self.path = location.local_file(LOCK)
        self.held = False

    def __enter__(self):
        if self.path is None:
            return self
        deadline = time.monotonic() + _LOCK_WAIT_SECONDS
        while True:
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                if self._stale() or time.monotonic() > deadline:
                    if not self._stale():
                        raise ConcurrentCommitError(
                            f"dataset {self.location.uri!r}: another commit holds {LOCK} for over "
                            f"{_LOCK_WAIT_SECONDS:.0f} s; delete it if no write is running"
                        ) from None
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self.path)
                    continue
                time.sleep(0.05)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(
                    {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}, f
                )
            self.held = True
            return self

    def _stale(self) -> bool:
        try:
            with open(self.path) as f:
                lease = json.load(f)
        except (OSError, ValueError):
            return False  # being written right now
        if not _alive(lease):
            return True
        return time.time() - lease.get("started", 0) > _LOCK_WAIT_SECONDS * 4

    def __exit__(self, *exc):
        if self.held:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


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


def abort_dataset(location: DatasetLocation, job_id: str) -> None:
    """Delete every file the job wrote (all attempts) that no manifest lists, and its lease;
    leave published files and other jobs' files alone."""
    location = DatasetLocation.of(location)
    # The lease goes first: an attempt still writing checks it after its last shard, so
    # it either sees it gone (and deletes its shards) or landed before the listing below.
    location.delete([lease_name(job_id)])
    listed: set[str] = set()
    if location.has(MANIFEST):
        with contextlib.suppress(ManifestError):
            listed = {e.shard_path for e in load_manifest(location).shards}
    tag = _job_tag(job_id)
    mine = [n for n in location.list() if n not in listed and job_of(n) == tag]
    location.delete([*mine, f"{STAGING}/{job_id}"])
    if location.has(STAGING) and not location.list_under(STAGING):
        location.delete([STAGING])
