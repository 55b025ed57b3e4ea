"""Write in-memory arrays as a batch-mode dataset: the layout the Spark writer produces,
for data that already sits in one process (conversions, tests, a plain Python loop)."""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np

from ..format.errors import InvalidArgumentError
from .build import DatasetBuilder
from .layout import MANIFEST
from .location import DatasetLocation
from .manifest import Manifest

DEFAULT_ROWS_PER_SHARD = 65_536
"""Rows per shard when none is given: a few MB to a few hundred MB for activations."""


def write_batch_dataset(
    root: str | os.PathLike,
    columns: Mapping[str, np.ndarray],
    *,
    rows_per_shard: int = DEFAULT_ROWS_PER_SHARD,
    metadata: Mapping[str, str] | None = None,
    overwrite: bool = False,
) -> Manifest:
    """Write ``columns`` (arrays sharing their first dim; dtypes stored as given, so cast
    with ``format.to_f16``/``to_bf16`` first) to ``root`` (a path or URI) as shards of
    ``rows_per_shard`` rows, committed like a Spark write (``DatasetBuilder``). Refuses a
    location that already holds a dataset unless ``overwrite``: then the new dataset
    replaces it at the commit point (readers see the old one or the new one, never a mix)
    and the old one's files are deleted.

        write_batch_dataset("acts", {"activation": to_f16(x), "sample_id": ids})
    """
    location = DatasetLocation.of(root)
    if location.has(MANIFEST) and not overwrite:
        raise FileExistsError(
            f"{location.uri} already holds a dataset ({MANIFEST}); pass overwrite=True to replace it"
        )
    if not columns:
        raise InvalidArgumentError("no columns to write")
    lengths = {name: len(a) for name, a in columns.items()}
    if len(set(lengths.values())) != 1:
        raise InvalidArgumentError(f"columns disagree on their number of rows: {lengths}")
    if rows_per_shard < 1:
        raise InvalidArgumentError("rows_per_shard must be >= 1")
    total = next(iter(lengths.values()))
    shard_metadata = dict(metadata) if metadata else None
    with DatasetBuilder(
        location, batch_size=min(rows_per_shard, total), metadata=metadata, overwrite=True
    ) as build:
        for start in range(0, total, rows_per_shard):
            part = {
                n: np.ascontiguousarray(a[start : start + rows_per_shard])
                for n, a in columns.items()
            }
            build.add_batch(part, shard_metadata=shard_metadata)
    return build.manifest
