"""Check a dataset against its manifest: every listed shard present, inside the directory,
of the listed size, with a valid header agreeing with the schema, and (optionally) its
checksum. All problems are reported at once."""

from __future__ import annotations

import os
from pathlib import Path

from ..format import SafetensorsFormatError
from .manifest import Manifest, ManifestError

_CHUNK = 16 << 20


def stream_crc32c(stream) -> str:
    """crc32c (hex) of everything a binary stream yields, read in 16 MB chunks."""
    import crc32c

    crc = 0
    while chunk := stream.read(_CHUNK):
        crc = crc32c.crc32c(chunk, crc)
    return f"{crc:08x}"


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
    root: str | os.PathLike, *, checksums: bool = False, filesystem=None
) -> Manifest:
    """Return the manifest when the dataset at ``root`` (a path or URI, see
    ``DatasetLocation.of``) is whole; raise ``ManifestError`` listing every problem found
    otherwise (checksums cover the shards and the tensor index)."""
    from .location import DatasetLocation

    return DatasetLocation.of(root, filesystem).verify(checksums=checksums)
