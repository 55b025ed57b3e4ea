"""Names and paths inside a dataset directory."""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path

MANIFEST = "dataset_manifest.json"
INDEX = "_tensor_index.parquet"
SUCCESS = "_SUCCESS"
STAGING = "_temporary"
SHARD_SUFFIX = ".safetensors"
SHARD_NAME = re.compile(r"^part-(\d{5,})-(\d{4,})-([0-9a-f-]{36})\.safetensors$")


def shard_name(task_id: int, shard_index: int, file_uuid: str | None = None) -> str:
    """``part-{taskId:05d}-{shardIndex:04d}-{uuid}.safetensors`` (format spec §3.2)."""
    return f"part-{task_id:05d}-{shard_index:04d}-{file_uuid or uuid.uuid4()}{SHARD_SUFFIX}"


def local_path(path: str | os.PathLike) -> Path:
    """A local filesystem path from a path or a ``file:`` URI."""
    text = os.fspath(path)
    if text.startswith("file://"):
        text = text[len("file://") :]
    elif text.startswith("file:"):
        text = text[len("file:") :]
    elif re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]+://", text):
        raise ValueError(
            f"{text!r}: only local paths (and file: URIs, FUSE mounts such as /dbfs or /Volumes) are supported here"
        )
    return Path(text)


def resolve_inside(root: Path, relative: str, *, what: str = "shard path") -> Path:
    """``root / relative``, refusing absolute paths and anything that escapes ``root``."""
    if not relative or os.path.isabs(relative) or "\\" in relative:
        raise ValueError(f"{what} {relative!r} in {str(root)!r} must be a relative file name")
    candidate = (root / relative).resolve()
    if not candidate.is_relative_to(root.resolve()):
        raise ValueError(f"{what} {relative!r} escapes the dataset directory {str(root)!r}")
    return candidate
