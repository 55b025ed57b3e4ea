"""Check a dataset against its manifest: every listed shard present, inside the directory,
of the listed size, with a valid header agreeing with the schema, and (optionally) its
checksum. All problems are reported at once."""

from __future__ import annotations

import os
from pathlib import Path

from ..format import SafetensorsFormatError, read_header
from .manifest import Manifest, ManifestError, load_manifest

_CHUNK = 16 << 20


def shard_crc32c(path: Path) -> str:
    import crc32c

    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = crc32c.crc32c(chunk, crc)
    return f"{crc:08x}"


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


def verify_dataset(root: str | os.PathLike, *, checksums: bool = False) -> Manifest:
    """Return the manifest when the dataset is whole; raise ``ManifestError`` listing
    every problem found otherwise."""
    root = Path(root)
    manifest = load_manifest(root)
    problems: list[str] = []
    for entry, path in zip(manifest.shards, manifest.shard_paths(root), strict=True):
        size = path.stat().st_size if path.exists() else None
        header = None
        if size is not None and size == entry.bytes:
            try:
                header = read_header(path)
            except SafetensorsFormatError as e:
                problems.append(str(e))
                continue
        problems += check_shard(manifest, entry, size, header)
        if header is not None and checksums and entry.crc32c and shard_crc32c(path) != entry.crc32c:
            problems.append(f"{entry.shard_path}: crc32c mismatch (file changed or corrupt)")
    if problems:
        raise ManifestError(f"dataset {str(root)!r} is not whole:\n  " + "\n  ".join(problems))
    return manifest
