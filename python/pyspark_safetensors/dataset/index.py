"""The tensor index: one row per tensor with absolute byte offsets, so a reader fetches
any tensor with one ranged read and no header parse. The commit writes it (the manifest
names it, ``_tensor_index-{commit}.parquet``, and ``_tensor_index.parquet`` holds the
same bytes); this module builds its rows and reads it back checked."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..format import DTYPES, Header, HeaderLayout
from ..format.header import HeaderColumns
from .errors import ManifestError
from .location import DatasetLocation
from .manifest import Manifest, load_manifest

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

INDEX_ROW_GROUP = 1 << 16
"""Rows per row group of an index this library writes (rows come shard by shard), so that
a reader of one shard's rows reads the groups whose statistics can hold it, not all."""


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


def read_index(
    location: DatasetLocation | str | os.PathLike,
    manifest: Manifest | None = None,
    *,
    checksums: bool = False,
) -> pa.Table:
    """The tensor index ``manifest`` (default: the dataset's) names, for a location, path
    or URI, checked: every row names a shard of the manifest, within its listed bytes
    (and with ``checksums`` the file's crc32c against the manifest's)."""
    location = DatasetLocation.of(location)
    manifest = manifest or load_manifest(location)
    if manifest.index_file is None:
        raise ManifestError(
            f"dataset {location.uri!r} has no tensor index; write it with generate_index=true"
        )
    name = manifest.index_file
    where = location.display(name)
    data = location.read_bytes(name)
    if checksums and manifest.index_crc32c:
        import crc32c

        if f"{crc32c.crc32c(data):08x}" != manifest.index_crc32c:
            raise ManifestError(f"{where!r}: crc32c mismatch (the index changed or is corrupt)")
    try:
        table = pq.read_table(pa.BufferReader(data), schema=INDEX_SCHEMA)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OSError) as e:
        raise ManifestError(f"{where!r}: not a readable tensor index ({e})") from None
    check_index(table, manifest, where)
    return table


class ShardIndex:
    """A dataset's tensor index, read once, handing out one shard's rows at a time (a
    reader of several shards reads the file once)."""

    def __init__(self, location: DatasetLocation | str | os.PathLike, manifest: Manifest):
        location = DatasetLocation.of(location)
        self.manifest, self.where = manifest, location.display(manifest.index_file)
        try:
            self._file = pq.ParquetFile(pa.BufferReader(location.read_bytes(manifest.index_file)))
        except (pa.ArrowInvalid, OSError) as e:
            raise ManifestError(f"{self.where!r}: not a readable tensor index ({e})") from None

    def rows(self, shard_path: str) -> pa.Table:
        """The index rows of one shard, checked as ``read_index`` checks them: only the
        row groups whose ``file_name`` statistics can hold it are decoded."""
        file = self._file
        try:
            column = file.schema_arrow.get_field_index("file_name")
            groups = []
            for g in range(file.num_row_groups):
                stats = file.metadata.row_group(g).column(column).statistics
                if stats is None or not stats.has_min_max or stats.min <= shard_path <= stats.max:
                    groups.append(g)
            table = file.read_row_groups(groups).cast(INDEX_SCHEMA)
        except (pa.ArrowInvalid, pa.ArrowTypeError, OSError, ValueError) as e:
            raise ManifestError(f"{self.where!r}: not a readable tensor index ({e})") from None
        table = table.filter(pc.equal(table["file_name"], shard_path))
        check_index(table, self.manifest, self.where)
        return table


def read_shard_index(
    location: DatasetLocation | str | os.PathLike, manifest: Manifest, shard_path: str
) -> pa.Table:
    """The index rows of one shard (``ShardIndex.rows``)."""
    return ShardIndex(location, manifest).rows(shard_path)


def shard_columns(rows: pa.Table, data_start: int, where: str) -> HeaderColumns:
    """One shard's index rows as its header's columns (offsets made relative to the byte
    buffer at ``data_start``), for readers that skip parsing a header of 10^5 entries."""
    names = rows.column("tensor_key").combine_chunks()
    offsets = np.frombuffer(names.buffers()[1], np.int32)[
        names.offset : names.offset + len(names) + 1
    ]
    data = names.buffers()[2]
    dtype_codes = rows.column("dtype").combine_chunks().dictionary_encode()
    try:
        dtypes = tuple(DTYPES[d] for d in dtype_codes.dictionary.to_pylist())
    except KeyError as e:
        raise ManifestError(
            f"{where!r}: index names dtype {e.args[0]!r}, not a safetensors dtype"
        ) from None
    shapes_list = rows.column("shape").combine_chunks()
    ranks = pc.list_value_length(shapes_list).to_numpy(zero_copy_only=False)
    width = int(ranks.max(initial=0))
    dims = np.full((len(ranks), width + 1), -1, dtype=np.int64)
    dims[:, 0] = ranks
    values = pc.list_flatten(shapes_list).to_numpy(zero_copy_only=False)
    if len(values):
        dims[np.repeat(np.arange(len(ranks)), ranks), 1 + _positions(ranks)] = values
    if len(dims) and (dims == dims[0]).all():  # one shape for every tensor: no sort
        table, shape_of = dims[:1], np.zeros(len(dims), np.int64)
    else:
        table, shape_of = np.unique(dims, axis=0, return_inverse=True)
    begins = rows.column("begin").to_numpy() - data_start
    ends = rows.column("end").to_numpy() - data_start
    if len(begins) and begins.min() < 0:
        raise ManifestError(
            f"{where!r}: index rows point into the shard's header; the index is not this dataset's"
        )
    return HeaderColumns(
        name_data=np.frombuffer(data, np.uint8) if data is not None else np.empty(0, np.uint8),
        name_offsets=offsets.astype(np.int64),
        dtypes=dtypes,
        dtype_of=dtype_codes.indices.to_numpy(zero_copy_only=False).astype(np.int64),
        shapes=tuple(tuple(int(v) for v in row[1 : 1 + row[0]]) for row in table),
        shape_of=shape_of.reshape(-1).astype(np.int64),
        begins=begins,
        ends=ends,
    )


def _positions(ranks: np.ndarray) -> np.ndarray:
    """0, 1, ..., ranks[i] - 1 for each i, one after another."""
    starts = np.repeat(np.cumsum(ranks) - ranks, ranks)
    return np.arange(int(ranks.sum())) - starts


def check_index(table: pa.Table, manifest: Manifest, where: str) -> None:
    """Every index row names a shard the manifest lists and a byte range inside it."""
    sizes = {s.shard_path: s.bytes for s in manifest.shards}
    files = table.column("file_name")
    unique = [f for f in files.unique().to_pylist()]
    strangers = [f for f in unique if f not in sizes]
    if strangers:
        raise ManifestError(
            f"{where!r}: index rows name file(s) the manifest does not list: "
            f"{', '.join(map(repr, strangers[:5]))}; the index is not this dataset's"
        )
    if not table.num_rows:
        return
    begins = table.column("begin").to_numpy()
    ends = table.column("end").to_numpy()
    limit = (
        np.array([sizes[f] for f in unique], dtype=np.int64)[
            files.dictionary_encode().combine_chunks().indices.to_numpy(zero_copy_only=False)
        ]
        if len(unique) > 1
        else np.full(len(begins), sizes[unique[0]], dtype=np.int64)
    )
    bad = np.flatnonzero((begins < 0) | (ends < begins) | (ends > limit))
    if len(bad):
        i = int(bad[0])
        raise ManifestError(
            f"{where!r}: index row {i} ({table.column('tensor_key')[i].as_py()!r}) points at bytes "
            f"[{begins[i]}, {ends[i]}) outside its shard"
        )
