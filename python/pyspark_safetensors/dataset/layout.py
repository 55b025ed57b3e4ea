"""Names and paths inside a dataset directory."""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path

from ..format.errors import InvalidArgumentError

MANIFEST = "dataset_manifest.json"
INDEX = "_tensor_index.parquet"
"""The spec's index: a directory of parquet parts, as Spark writes one (``spark.read.parquet``
reads a root path whose name starts with ``_`` only as a directory)."""
INDEX_PART = f"{INDEX}/part-00000.parquet"
SUCCESS = "_SUCCESS"
STAGING = "_temporary"
SHARD_SUFFIX = ".safetensors"
SHARD_NAME = re.compile(r"^part-(\d{5,})-(\d{4,})-([0-9a-f-]{36})\.safetensors$")


INDEX_NAME = re.compile(r"^_tensor_index(-[0-9a-f]{32})?\.parquet$")
JOB_LEASE_SUFFIX = ".job"


NULL_PARTITION = "__HIVE_DEFAULT_PARTITION__"
_ESCAPED = set("\"#%'*/:=?\\\x7f{[]^") | {chr(c) for c in range(0x20)}


def partition_dir(column: str, value: str | None) -> str:
    """The Hive-style directory ``column=value`` of one partition, escaped as Spark (and
    the JVM writer's ``partitionBy``) escapes it; a null or empty value is
    ``__HIVE_DEFAULT_PARTITION__``."""

    def escape(text: str) -> str:
        return "".join(f"%{ord(c):02X}" if c in _ESCAPED else c for c in text)

    return f"{escape(column)}={escape(value) if value else NULL_PARTITION}"


def shard_name(task_id: int, shard_index: int, file_uuid: str | None = None) -> str:
    """``part-{taskId:05d}-{shardIndex:04d}-{uuid}.safetensors`` (format spec §3.2)."""
    return f"part-{task_id:05d}-{shard_index:04d}-{file_uuid or uuid.uuid4()}{SHARD_SUFFIX}"


def attempt_uuid(job_id: str) -> str:
    """A file uuid for one task attempt of job ``job_id`` (32 hex digits): its first 16
    digits are the job's, so the commit and later writes know which job left a shard;
    the rest are random, so every attempt writes names of its own."""
    tail = uuid.uuid4().hex
    return f"{job_id[:8]}-{job_id[8:12]}-{job_id[12:16]}-{tail[:4]}-{tail[4:16]}"


def job_of(name: str) -> str | None:
    """The 16-digit job tag of a shard name written by ``attempt_uuid``, else None."""
    m = SHARD_NAME.match(name)
    return m.group(3).replace("-", "")[:16] if m else None


def index_name(commit_id: str) -> str:
    """The tensor index of one commit; the manifest names it, so a crash between the two
    writes can never pair an old manifest with a new index."""
    return f"_tensor_index-{commit_id}.parquet"


# -- the KV tensor-name rule: one definition for the writer and both readers


def kv_suffix(column: str, separator: str) -> str:
    return f"{separator}{column}"


def kv_tensor_name(key: str, column: str, separator: str) -> str:
    """The tensor holding ``column`` of the row keyed ``key``: ``{key}{separator}{column}``."""
    return key + kv_suffix(column, separator)


def check_kv_columns(columns: list[str] | tuple[str, ...], separator: str) -> None:
    """Refuse column sets whose names cannot be told apart after ``{key}{separator}``: a
    column whose ``{separator}{column}`` ends another's (``b`` and ``a__b`` with ``__``).
    Keys, and columns that merely contain the separator, round-trip."""
    suffixes = {c: kv_suffix(c, separator) for c in columns}
    for a in columns:
        for b in columns:
            if a != b and suffixes[a].endswith(suffixes[b]):
                raise InvalidArgumentError(
                    f"KV columns {b!r} and {a!r} cannot be told apart in tensor names "
                    f"'<key>{separator}<column>' (a key ending in {a[: len(a) - len(b)]!r}... is ambiguous); "
                    "rename one of them or choose another kv_separator"
                )


def split_kv_name(name: str, columns, separator: str) -> tuple[str, str] | None:
    """``(key, column)`` of a KV tensor name given the dataset's columns (the longest
    column suffix wins, which ``check_kv_columns`` makes unique), or None."""
    best = None
    for column in columns:
        suffix = kv_suffix(column, separator)
        if name.endswith(suffix) and (best is None or len(column) > len(best)):
            best = column
    if best is None:
        return None
    return name[: len(name) - len(kv_suffix(best, separator))], best


def resolve_inside(root: Path, relative: str, *, what: str = "shard path") -> Path:
    """``root / relative``, refusing absolute paths and anything that escapes ``root``."""
    if not relative or os.path.isabs(relative) or "\\" in relative:
        raise InvalidArgumentError(
            f"{what} {relative!r} in {str(root)!r} must be a relative file name"
        )
    candidate = (root / relative).resolve()
    if not candidate.is_relative_to(root.resolve()):
        raise InvalidArgumentError(
            f"{what} {relative!r} escapes the dataset directory {str(root)!r}"
        )
    return candidate
