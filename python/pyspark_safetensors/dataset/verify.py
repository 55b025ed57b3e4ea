"""Check a dataset against its manifest: every listed shard present, inside the directory,
of the listed size, with a valid header agreeing with the schema, and (optionally) its
checksum. All problems are reported at once."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow.fs as pafs

from ..format import SafetensorsFormatError
from .errors import ManifestError
from .index import read_index
from .location import DatasetLocation, stream_crc32c
from .manifest import Manifest, load_manifest
from .shards import read_header


def shard_crc32c(path: Path) -> str:
    with open(path, "rb") as f:
        return stream_crc32c(f)


def check_shard(manifest: Manifest, entry, size: int | None, header) -> list[str]:
    """Problems of one shard: missing (``size`` None), mis-sized, or a header (given when
    the size is right) disagreeing with the schema."""
    if size is None:
        return [f"{entry.shard_path}: listed in the manifest but missing"]
    if size != entry.bytes:
        return [f"{entry.shard_path}: {size} bytes on disk, the manifest says {entry.bytes}"]
    problems = []
    if manifest.mode == "batch":
        for name, col in manifest.schema.items():
            if name not in header:
                problems.append(f"{entry.shard_path}: no tensor {name!r}")
                continue
            info = header[name]
            if (
                info.dtype.name != col.dtype
                or info.shape[1:] != col.sample_shape
                or info.shape[0] != entry.samples_count
            ):
                problems.append(
                    f"{entry.shard_path}: tensor {name!r} is {info.dtype}{list(info.shape)}, the manifest says "
                    f"{col.dtype}[{entry.samples_count}, {', '.join(map(str, col.sample_shape))}]"
                )
    return problems


def verify_shards(
    manifest: Manifest,
    where: str,
    size_of,
    header_of,
    crc32c_of,
    *,
    checksums: bool,
    extra: list[str] | None = None,
) -> Manifest:
    """Check every shard of ``manifest`` with the given probes (``size_of(entry)`` → size
    or None when missing, ``header_of(entry)``, ``crc32c_of(entry)``); raise
    ``ManifestError`` listing every problem (``extra`` collects those the probes found),
    naming ``where``."""
    problems: list[str] = extra if extra is not None else []
    for entry in manifest.shards:
        before = len(problems)
        size = size_of(entry)
        if len(problems) > before:  # the probe refused the file (not a regular file)
            continue
        header = None
        if size is not None and size == entry.bytes:
            try:
                header = header_of(entry)
            except SafetensorsFormatError as e:
                problems.append(str(e))
                continue
        problems += check_shard(manifest, entry, size, header)
        if header is not None and checksums and entry.crc32c and crc32c_of(entry) != entry.crc32c:
            problems.append(f"{entry.shard_path}: crc32c mismatch (file changed or corrupt)")
    if problems:
        raise ManifestError(f"dataset {where!r} is not whole:\n  " + "\n  ".join(problems))
    return manifest


def verify_dataset(
    root: str | os.PathLike | DatasetLocation,
    *,
    checksums: bool = False,
    filesystem=None,
    manifest: Manifest | None = None,
) -> Manifest:
    """The manifest (``manifest``, else the dataset's) when the dataset at ``root`` (a
    ``DatasetLocation``, path or URI, see ``DatasetLocation.of``) is whole: every shard
    present, a regular file of the listed size, its header agreeing with the schema and
    its row count, and with ``checksums`` the crc32c of every shard and of the tensor
    index; a partitioned dataset's every partition so, each listing the shards the
    dataset's manifest lists under it. Raises ``ManifestError`` listing every problem found."""
    location = DatasetLocation.of(root, filesystem)
    manifest = manifest or load_manifest(location)
    if manifest.partition_columns:
        return _verify_partitions(location, manifest, checksums)
    listing = location.list()
    problems: list[str] = []

    def size_of(entry):
        info = listing.get(entry.shard_path)
        if info is None or info.type == pafs.FileType.NotFound:
            return None
        if info.type != pafs.FileType.File:  # a FIFO, directory or device
            problems.append(f"{entry.shard_path}: not a regular file")
            return -1
        return info.size

    checked = verify_shards(
        manifest,
        location.uri,
        size_of,
        lambda e: read_header(location, e.shard_path, e.bytes),
        lambda e: location.stream_crc32c(e.shard_path),
        checksums=checksums,
        extra=problems,
    )
    if checksums and manifest.index_file is not None:
        read_index(location, manifest, checksums=True)
    return checked


def _verify_partitions(location: DatasetLocation, manifest: Manifest, checksums: bool) -> Manifest:
    """A partitioned dataset's partitions verified one by one, each against the root."""
    problems: list[str] = []
    by_dir: dict[str, set[str]] = {}
    for s in manifest.shards:
        folder, _, name = s.shard_path.rpartition("/")
        by_dir.setdefault(folder, set()).add(name)
    for folder, names in sorted(by_dir.items()):
        try:
            own = verify_dataset(location.child(folder), checksums=checksums)
        except ManifestError as e:
            problems.append(str(e))
            continue
        if {s.shard_path for s in own.shards} != names:
            problems.append(
                f"{folder}: its manifest lists other shards than the dataset's manifest does under it"
            )
    if problems:
        raise ManifestError(
            f"dataset {location.uri!r}: {len(problems)} partition(s) fail: " + "; ".join(problems)
        )
    return manifest
