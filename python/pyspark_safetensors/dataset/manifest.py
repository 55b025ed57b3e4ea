"""``dataset_manifest.json``: what a dataset holds. Readers list shards from it and never
glob the directory; writers replace it last, atomically, so it is the commit point."""

from __future__ import annotations

import functools
import json
import os
import uuid
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Literal

from .._version import __version__
from .errors import DatasetReplacedError, ManifestError, PartitionedDatasetError
from .layout import MANIFEST, resolve_inside
from .location import DatasetLocation

FORMAT_VERSION = "1.0"
SAFETENSORS_VERSION = "1.0"


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
    partition_columns: tuple[str, ...] = ()
    """A partitioned dataset's columns (the JVM writer's ``partitionBy``): its shards lie in
    ``col=value/`` directories, each a dataset of its own."""
    stream_commits: dict[str, int] = field(default_factory=dict)
    """Streams appending to the dataset: stream id -> the last batch id it committed (a
    replayed batch commits nothing); every commit carries it forward."""
    stream_checkpoints: dict[str, str] = field(default_factory=dict)
    """Streams appending to the dataset: stream id -> the checkpoint location its batches
    were committed from (a stream id continues only from its checkpoint: under a new one
    its batch ids start again at 0); carried forward like ``stream_commits``."""
    complete: bool = False
    """The producer declared the dataset finished (``mark_complete``): appends refused."""

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
            "partition_columns": list(self.partition_columns) or None,
            "stream_commits": dict(self.stream_commits) or None,
            "stream_checkpoints": dict(self.stream_checkpoints) or None,
            "complete": self.complete or None,
            "created_by": self.created_by,
            "created_at": self.created_at,
            "metadata": self.metadata,
        }
        doc.update({k: v for k, v in optional.items() if v is not None})
        return doc

    @classmethod
    def from_json(cls, doc: object, where: str) -> Manifest:
        """Parse and check a manifest document against ``manifest-jsonschema.json`` plus
        what a schema cannot say (unique shard paths, totals equal to the sums); errors
        name ``where`` and the field."""

        def fail(msg):
            raise ManifestError(f"{where}: {msg}")

        problem = schema_problem(doc)
        if problem:
            fail(problem)
        shards = tuple(
            ShardEntry(
                s["shard_path"],
                s["samples_count"],
                s["bytes"],
                s.get("first_sample"),
                s.get("crc32c"),
            )
            for s in doc["shards"]
        )
        seen: set[str] = set()
        for i, s in enumerate(shards):
            if s.shard_path in seen:
                fail(
                    f"shards[{i}] lists {s.shard_path!r} a second time; each shard may appear once"
                )
            seen.add(s.shard_path)
        schema = {
            name: ColumnSchema(
                c["dtype"], tuple(c["shape"]), tuple(c.get("sample_shape", c["shape"][1:]))
            )
            for name, c in doc["schema"].items()
        }
        manifest = cls(
            shards=shards,
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
            partition_columns=tuple(doc.get("partition_columns") or ()),
            stream_commits=dict(doc.get("stream_commits") or {}),
            stream_checkpoints=dict(doc.get("stream_checkpoints") or {}),
            complete=bool(doc.get("complete", False)),
        )
        if (
            manifest.total_samples != doc["total_samples"]
            or manifest.total_bytes != doc["total_bytes"]
        ):
            fail("total_samples/total_bytes disagree with the sum over shards")
        return manifest

    def refuse_partitioned(self, uri: str, reader: str) -> None:
        """Raise, in one line, when this manifest is a partitioned dataset's root, which
        ``reader`` reads one partition at a time."""
        if self.partition_columns:
            first = self.shards[0].shard_path.rpartition("/")[0] if self.shards else None
            example = f" (e.g. {uri.rstrip('/')}/{first})" if first else ""
            raise PartitionedDatasetError(
                f"dataset {uri!r} is partitioned by {list(self.partition_columns)}: {reader} reads "
                f"one partition's directory{example}; the JVM source (the shim jar) reads the "
                "whole dataset with its partition columns"
            )

    def shard_paths(self, root: Path) -> list[Path]:
        """Absolute shard paths, each checked to stay inside ``root``."""
        return [resolve_inside(root, s.shard_path) for s in self.shards]


MANIFEST_SCHEMA = "manifest-jsonschema.json"
"""The JSON Schema of ``dataset_manifest.json``, shipped beside this module."""


@functools.cache
def _validator():
    import jsonschema

    schema = json.loads((resources.files(__package__) / MANIFEST_SCHEMA).read_text())
    return jsonschema.validators.validator_for(schema)(schema)


def _field(path) -> str:
    """A JSON path as users read it: ``shards[2].bytes``."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def schema_problem(doc: object) -> str | None:
    """What makes ``doc`` break ``manifest-jsonschema.json`` (the most relevant error),
    or None."""
    from jsonschema.exceptions import best_match

    error = best_match(_validator().iter_errors(doc))
    if error is None:
        return None
    field = _field(error.absolute_path)
    if error.validator == "required":
        missing = error.message.split("'")[1] if "'" in error.message else error.message
        return f"missing required field {_field([*error.absolute_path, missing])!r}"
    if field.endswith(".shard_path") and error.validator == "pattern":
        return (
            f"{field} {error.instance!r} must be a relative name inside the dataset, "
            "ending in .safetensors"
        )
    if field == "format_version":
        return f"format_version {error.instance!r} is not supported (1.x expected)"
    if error.validator == "type" and not field:
        return "the manifest is not a JSON object"
    return f"{field or 'the manifest'}: {error.message}"


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


def load_manifest(location: DatasetLocation | str | os.PathLike) -> Manifest:
    """The manifest of the dataset at ``location`` (a ``DatasetLocation``, path or URI),
    parsed and checked: fields, totals, duplicate names, and every listed name (shards,
    index) a relative name inside the dataset."""
    location = DatasetLocation.of(location)

    def read():
        try:
            return location.read_bytes(MANIFEST)
        except DatasetReplacedError:
            raise FileNotFoundError(MANIFEST) from None

    manifest = parse_manifest(read, location.uri, location.display(MANIFEST))
    for shard in manifest.shards:
        location.path(shard.shard_path)
    if manifest.index_file is not None:
        location.path(manifest.index_file, what="index_file")
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
