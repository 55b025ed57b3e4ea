"""``_tensor_index.parquet``: one row per tensor with absolute byte offsets, so a reader
fetches any tensor with one ranged read and no header parse."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..format import Header, HeaderLayout
from .layout import INDEX

INDEX_SCHEMA = pa.schema(
    [
        ("tensor_key", pa.string()),
        ("file_name", pa.string()),
        ("shape", pa.list_(pa.int32())),
        ("dtype", pa.string()),
        ("begin", pa.int64()),
        ("end", pa.int64()),
    ]
)
"""The spec's four columns plus absolute file offsets [begin, end) of the tensor bytes."""


def index_rows(file_name: str, header: Header) -> pa.Table:
    """Index rows for one shard's header."""
    ids: dict = {}
    spec_of = [ids.setdefault((t.dtype, t.shape), len(ids)) for t in header.tensors]
    return _table(
        file_name,
        [t.name for t in header.tensors],
        list(ids),
        np.array(spec_of, dtype=np.int64),
        np.array([header.data_start + t.begin for t in header.tensors], dtype=np.int64),
        np.array([header.data_start + t.end for t in header.tensors], dtype=np.int64),
    )


def index_table(file_name: str, layout: HeaderLayout) -> pa.Table:
    """Index rows for one shard written with ``format.write_packed``, built in bulk."""
    return _table(
        file_name,
        layout.names,
        layout.specs,
        layout.spec_of,
        layout.data_start + layout.begins,
        layout.data_start + layout.ends,
    )


def _table(file_name, names, specs, spec_of, begins, ends) -> pa.Table:
    spec_of = pa.array(spec_of, pa.int64())
    shapes = pa.array([list(shape) for _, shape in specs], INDEX_SCHEMA.field("shape").type)
    dtypes = pa.array([dtype.name for dtype, _ in specs], pa.string())
    same_file = pa.DictionaryArray.from_arrays(
        pa.array(np.zeros(len(names), dtype=np.int32)), pa.array([file_name])
    )
    return pa.table(
        [
            pa.array(names, pa.string()),
            same_file.cast(pa.string()),
            shapes.take(spec_of),
            dtypes.take(spec_of),
            pa.array(begins, pa.int64()),
            pa.array(ends, pa.int64()),
        ],
        schema=INDEX_SCHEMA,
    )


def write_index(root: Path, tables: list[pa.Table]) -> None:
    table = (
        pa.concat_tables([t.cast(INDEX_SCHEMA) for t in tables])
        if tables
        else INDEX_SCHEMA.empty_table()
    )
    tmp = root / f".{INDEX}.{uuid.uuid4().hex}.tmp"
    try:
        # Keys are unique: dictionary-encoding them only costs time.
        pq.write_table(table, tmp, use_dictionary=["file_name", "dtype"])
        os.replace(tmp, root / INDEX)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_index(root: str | os.PathLike, *, checksums: bool = False) -> pa.Table:
    """The tensor index the dataset's manifest names (every row checked to name a listed
    shard), for a path or URI; ``_tensor_index.parquet`` when there is no manifest."""
    from .layout import MANIFEST
    from .location import DatasetLocation

    location = DatasetLocation.of(root)
    if not location.has(MANIFEST):
        return pq.read_table(Path(location.root) / INDEX, schema=INDEX_SCHEMA)
    return location.read_index(location.load_manifest(), checksums=checksums)
