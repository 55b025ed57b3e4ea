"""``_tensor_index.parquet``: one row per tensor with absolute byte offsets, so a reader
fetches any tensor with one ranged read and no header parse."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

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


def index_rows(file_name: str, header) -> dict[str, list]:
    """Index columns for one shard's header (``format.Header``)."""
    start = header.data_start
    return {
        "tensor_key": [t.name for t in header.tensors],
        "file_name": [file_name] * len(header.tensors),
        "shape": [list(t.shape) for t in header.tensors],
        "dtype": [t.dtype.name for t in header.tensors],
        "begin": [start + t.begin for t in header.tensors],
        "end": [start + t.end for t in header.tensors],
    }


def write_index(root: Path, tables: list[pa.Table]) -> None:
    table = (
        pa.concat_tables([t.cast(INDEX_SCHEMA) for t in tables])
        if tables
        else INDEX_SCHEMA.empty_table()
    )
    tmp = root / f".{INDEX}.{uuid.uuid4().hex}.tmp"
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, root / INDEX)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_index(root: str | os.PathLike) -> pa.Table:
    return pq.read_table(Path(root) / INDEX, schema=INDEX_SCHEMA)
