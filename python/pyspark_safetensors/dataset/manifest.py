"""``dataset_manifest.json``: what a dataset holds. Readers list shards from it and never
glob the directory; writers replace it last, atomically, so it is the commit point."""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from .._version import __version__
from ..format import WRITABLE
from .layout import MANIFEST, resolve_inside

FORMAT_VERSION = "1.0"
SAFETENSORS_VERSION = "1.0"


class ManifestError(ValueError):
    """A manifest is missing, malformed or disagrees with the files it lists."""


@dataclass(frozen=True)
class ShardEntry:
    shard_path: str
    samples_count: int
    bytes: int
    first_sample: int | None = None
    crc32c: str | None = None

    def to_json(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class ColumnSchema:
    dtype: str
    shape: tuple[int, ...]
    """Batch mode: shape of a full shard, [batch_size, *sample_shape]; KV: one row's tensor."""
    sample_shape: tuple[int, ...]

    def to_json(self) -> dict:
        return {
            "dtype": self.dtype,
            "shape": list(self.shape),
            "sample_shape": list(self.sample_shape),
        }


@dataclass(frozen=True)
class Manifest:
    """A dataset manifest (format spec §2.2 plus our optional fields)."""

    shards: tuple[ShardEntry, ...]
    schema: dict[str, ColumnSchema]
    mode: Literal["batch", "kv"] = "batch"
    batch_size: int | None = None
    name_col: str | None = None
    kv_separator: str | None = None
    index_file: str | None = None
    index_crc32c: str | None = None
    """Hex crc32c of the index file (checked with ``checksums=True``)."""
    commit_id: str | None = None
    """Unique per commit; the next commit names it as ``parent_commit``."""
    parent_commit: str | None = None
    """The ``commit_id`` of the manifest this commit replaced (None for a first write)."""
    metadata: dict[str, str] = field(default_factory=dict)
    created_by: str = f"pyspark-safetensors {__version__}"
    created_at: str | None = None

    @property
    def total_samples(self) -> int:
        return sum(s.samples_count for s in self.shards)

    @property
    def total_bytes(self) -> int:
        return sum(s.bytes for s in self.shards)

    def to_json(self) -> dict:
        doc = {
            "format_version": FORMAT_VERSION,
            "safetensors_version": SAFETENSORS_VERSION,
            "total_samples": self.total_samples,
            "total_bytes": self.total_bytes,
            "shards": [s.to_json() for s in self.shards],
            "schema": {name: c.to_json() for name, c in self.schema.items()},
            "mode": self.mode,
        }
        optional = {
            "batch_size": self.batch_size,
            "name_col": self.name_col,
            "kv_separator": self.kv_separator,
            "index_file": self.index_file,
            "index_crc32c": self.index_crc32c,
            "commit_id": self.commit_id,
            "parent_commit": self.parent_commit,
            "created_by": self.created_by,
            "created_at": self.created_at,
            "metadata": self.metadata,
        }
        doc.update({k: v for k, v in optional.items() if v is not None})
        return doc

    @classmethod
    def from_json(cls, doc: object, where: str) -> Manifest:
        """Parse and check a manifest document; errors name ``where`` and the field."""

        def fail(msg):
            raise ManifestError(f"{where}: {msg}")

        if not isinstance(doc, dict):
            fail("the manifest is not a JSON object")
        for key in ("format_version", "total_samples", "total_bytes", "shards", "schema"):
            if key not in doc:
                fail(f"missing required field {key!r}")
        if not str(doc["format_version"]).startswith("1."):
            fail(f"format_version {doc['format_version']!r} is not supported (1.x expected)")
        shards = []
        for i, s in enumerate(
            doc["shards"] if isinstance(doc["shards"], list) else fail("'shards' is not a list")
        ):
            if not isinstance(s, dict) or not {"shard_path", "samples_count", "bytes"} <= s.keys():
                fail(f"shards[{i}] lacks shard_path, samples_count or bytes")
            if not all(
                isinstance(s[k], int) and not isinstance(s[k], bool) and s[k] >= 0
                for k in ("samples_count", "bytes")
            ):
                fail(f"shards[{i}] samples_count and bytes must be non-negative integers")
            if not isinstance(s["shard_path"], str):
                fail(f"shards[{i}].shard_path must be a string")
            shards.append(
                ShardEntry(
                    str(s["shard_path"]),
                    s["samples_count"],
                    s["bytes"],
                    s.get("first_sample"),
                    s.get("crc32c"),
                )
            )
        seen: set[str] = set()
        for i, s in enumerate(shards):
            if s.shard_path in seen:
                fail(
                    f"shards[{i}] lists {s.shard_path!r} a second time; each shard may appear once"
                )
            seen.add(s.shard_path)
        for key in ("index_file", "index_crc32c", "commit_id", "parent_commit"):
            if doc.get(key) is not None and not isinstance(doc[key], str):
                fail(f"{key!r} must be a string")
        schema = {}
        for name, c in (
            doc["schema"] if isinstance(doc["schema"], dict) else fail("'schema' is not an object")
        ).items():
            if (
                not isinstance(c, dict)
                or c.get("dtype") not in WRITABLE
                or not isinstance(c.get("shape"), list)
            ):
                fail(
                    f"schema entry {name!r} needs a dtype of {', '.join(WRITABLE)} and a shape list"
                )
            schema[name] = ColumnSchema(
                c["dtype"], tuple(c["shape"]), tuple(c.get("sample_shape", c["shape"][1:]))
            )
        manifest = cls(
            shards=tuple(shards),
            schema=schema,
            mode=doc.get("mode", "kv" if doc.get("name_col") else "batch"),
            batch_size=doc.get("batch_size"),
            name_col=doc.get("name_col"),
            kv_separator=doc.get("kv_separator"),
            index_file=doc.get("index_file"),
            index_crc32c=doc.get("index_crc32c"),
            commit_id=doc.get("commit_id"),
            parent_commit=doc.get("parent_commit"),
            metadata=dict(doc.get("metadata") or {}),
            created_by=doc.get("created_by", "unknown"),
            created_at=doc.get("created_at"),
        )
        if (
            manifest.total_samples != doc["total_samples"]
            or manifest.total_bytes != doc["total_bytes"]
        ):
            fail("total_samples/total_bytes disagree with the sum over shards")
        return manifest

    def shard_paths(self, root: Path) -> list[Path]:
        """Absolute shard paths, each checked to stay inside ``root``."""
        return [resolve_inside(root, s.shard_path) for s in self.shards]


def parse_manifest(read, root: str, path: str) -> Manifest:
    """The manifest from ``read()`` (its bytes or text), errors naming ``path``."""
    try:
        text = read()
    except FileNotFoundError:
        raise ManifestError(
            f"{path!r}: no {MANIFEST}; is {root!r} a dataset written by pyspark-safetensors?"
        ) from None
    try:
        doc = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ManifestError(f"{path!r}: not valid JSON ({e})") from None
    except RecursionError:  # a hostile document nested past Python's stack
        raise ManifestError(f"{path!r}: JSON nested too deeply to be a manifest") from None
    return Manifest.from_json(doc, repr(path))


def load_manifest(root: str | os.PathLike) -> Manifest:
    root = Path(root)
    path = root / MANIFEST
    manifest = parse_manifest(lambda: path.read_bytes(), str(root), str(path))
    manifest.shard_paths(root)  # refuse escaping paths at load time
    return manifest


def write_json_atomic(path: Path, doc: object) -> None:
    """Write JSON to a temporary name, fsync, rename over ``path``."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=2, ensure_ascii=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_manifest(root: Path, manifest: Manifest) -> None:
    write_json_atomic(root / MANIFEST, manifest.to_json())
