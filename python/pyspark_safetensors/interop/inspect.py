"""What a path holds, and whether it is whole, for any format this package reads: our
datasets (local or a URI), single ``.safetensors`` files, saev dumps and Zarr stores or
runs. The ``inspect`` and ``verify`` commands print what these return.
"""

from __future__ import annotations

from pathlib import Path

from ..dataset import MANIFEST, DatasetLocation, load_manifest, read_header
from .convert import detect_source


def describe(path: str, *, limit: int = 20) -> list[str]:
    """Lines summarising ``path``: a dataset (mode, samples, shards, size, the writer,
    columns, metadata), a ``.safetensors`` file (its first ``limit`` tensors), or, for a saev dump
    or a Zarr store, what ``verify`` says of it (their summaries are their checks)."""
    location = DatasetLocation.of(path)  # a local path or any URI (s3://, gs://, ...)
    has_manifest = location.has(MANIFEST)
    if not has_manifest and Path(path).is_dir():
        kind = detect_source(Path(path))  # refuses what is none of the formats
        if kind != "safetensors":
            return [verify(path, checksums=False)]
    if has_manifest:
        m = load_manifest(location)
        lines = [
            f"{location}: {m.mode} dataset, {m.total_samples:,} samples in "
            f"{len(m.shards)} shards, {m.total_bytes / 1e6:,.1f} MB",
            f"  written by {m.created_by}",  # "(JVM)" when the shim's writer wrote it
        ]
        lines += [
            f"  {name}: {col.dtype} sample shape {list(col.sample_shape)}"
            for name, col in m.schema.items()
        ]
        lines += [f"  metadata {k} = {v}" for k, v in m.metadata.items()]
        if m.partition_columns:
            lines.append(
                f"  partitioned by {list(m.partition_columns)}: {_partitions(m)} partitions"
            )
        return lines
    parent, name = location.parent()
    header = read_header(parent, name)
    lines = [
        f"{location}: {len(header.tensors)} tensors, {header.data_bytes / 1e6:,.1f} MB of data"
    ]
    lines += [f"  {t.name}: {t.dtype} {list(t.shape)}" for t in header.tensors[:limit]]
    if len(header.tensors) > limit:
        lines.append(f"  ... {len(header.tensors) - limit} more")
    return lines


def verify(path: str, *, checksums: bool = True) -> str:
    """Check ``path`` whole and say so in one line: a dataset against its manifest (sizes,
    headers and, with ``checksums``, each shard's crc32c), a saev dump or a Zarr store
    against its metadata. Raises the format's error naming what is wrong."""
    kind = detect_source(path) if Path(path).is_dir() else "safetensors"
    if kind == "saev":
        from .saev import verify_dump

        return str(verify_dump(path))
    if kind in ("zarr", "zarr-run"):
        from .zarr import verify_store

        return str(verify_store(path))
    from ..dataset import verify_dataset

    m = verify_dataset(path, checksums=checksums)
    where = f" in {_partitions(m)} partitions" if m.partition_columns else ""
    return f"{path}: whole ({len(m.shards)} shards{where}, {m.total_samples:,} samples)"


def _partitions(m) -> int:
    return len({s.shard_path.rpartition("/")[0] for s in m.shards})
