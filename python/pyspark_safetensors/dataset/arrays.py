"""Write in-memory arrays as a batch-mode dataset: the layout the Spark writer produces,
for data that already sits in one process (conversions, tests, a plain Python loop)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from ..format import dtype_of, write_shard
from ..format.errors import InvalidArgumentError
from .layout import MANIFEST, shard_name
from .manifest import ColumnSchema, Manifest, ShardEntry, write_manifest
from .verify import shard_crc32c

DEFAULT_ROWS_PER_SHARD = 65_536
"""Rows per shard when none is given: a few MB to a few hundred MB for activations."""


def write_batch_dataset(
    root: str | os.PathLike,
    columns: Mapping[str, np.ndarray],
    *,
    rows_per_shard: int = DEFAULT_ROWS_PER_SHARD,
    metadata: Mapping[str, str] | None = None,
) -> Manifest:
    """Write ``columns`` (arrays sharing their first dim; dtypes stored as given, so cast
    with ``format.to_f16``/``to_bf16`` first) to ``root`` as shards of ``rows_per_shard``
    rows, then the manifest last. Refuses a directory that already holds a dataset.

        write_batch_dataset("acts", {"activation": to_f16(x), "sample_id": ids})
    """
    root = Path(root)
    if (root / MANIFEST).exists():
        raise FileExistsError(f"{root} already holds a dataset ({MANIFEST})")
    if not columns:
        raise InvalidArgumentError("no columns to write")
    lengths = {name: len(a) for name, a in columns.items()}
    if len(set(lengths.values())) != 1:
        raise InvalidArgumentError(f"columns disagree on their number of rows: {lengths}")
    if rows_per_shard < 1:
        raise InvalidArgumentError("rows_per_shard must be >= 1")
    total = next(iter(lengths.values()))
    root.mkdir(parents=True, exist_ok=True)
    entries = []
    for s, start in enumerate(range(0, total, rows_per_shard)):
        part = {
            n: np.ascontiguousarray(a[start : start + rows_per_shard]) for n, a in columns.items()
        }
        name = shard_name(0, s)
        header = write_shard(root / name, part, dict(metadata) if metadata else None)
        rows = min(rows_per_shard, total - start)
        entries.append(ShardEntry(name, rows, header.file_size, start, shard_crc32c(root / name)))
    batch = min(rows_per_shard, total)
    schema = {
        n: ColumnSchema(dtype_of(a).name, (batch, *a.shape[1:]), tuple(a.shape[1:]))
        for n, a in columns.items()
    }
    manifest = Manifest(
        tuple(entries), schema, mode="batch", batch_size=batch, metadata=dict(metadata or {})
    )
    write_manifest(root, manifest)
    return manifest
