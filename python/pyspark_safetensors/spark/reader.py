"""The read side of the ``safetensors`` source: input resolution, schema inference,
partition planning, and Arrow batches built from mmap views (no per-row Python objects).

Views:
- ``rows``: batch-mode datasets; one row per sample (the leading dimension unstacked).
- ``kv``: KV datasets; one row per key, the key column restored from the tensor names.
- ``tensors``: any safetensors files; one row per tensor (``file, name, dtype, shape,
  data``), ``data`` left out with ``include_data=false`` (header-only: no tensor bytes read).
- ``files``: any safetensors files; one row per file, one Tensor Struct column per tensor
  name (the read model of the Scala safetensors connector; a file without a tensor gives
  null there).
- ``index``: datasets; the rows of ``rows``/``kv`` without tensor bytes (``file``, ``row``,
  the key, and each column's ``dtype`` and ``shape``), from the manifest and the tensor
  index: counts and metadata without reading shards (a Python data source is never told
  that a query needs no column).
"""

from __future__ import annotations

import fnmatch
import itertools
import math
import operator
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
from pyspark.sql.datasource import DataSourceReader, InputPartition
from pyspark.sql.types import ArrayType, DataType, LongType, StringType, StructField, StructType

from ..dataset import (
    MANIFEST,
    STAGING,
    ColumnSchema,
    DatasetLocation,
    Manifest,
    ManifestError,
    ShardIndex,
    load_manifest,
    open_shard,
    open_shard_bytes,
    read_header,
    read_index,
    shard_columns,
    split_storage_options,
)
from ..dataset.layout import SHARD_NAME, kv_suffix
from ..dataset.verify import check_shard
from ..format.errors import PysparkSafetensorsError, SafetensorsFormatError
from ..format.header import HeaderColumns
from .compat import pushdown_enabled
from .dtypes import READ_TYPES
from .options import OptionError, ReaderOptions
from .tensor_struct import (
    MAX_DIMENSION,
    TENSOR_STRUCT_ARROW,
    TENSOR_STRUCT_TYPE,
    TensorStructError,
    assemble_tensor_structs,
    is_tensor_struct,
    repeated_string,
    struct_shape,
    tensor_structs_of_rows,
)

MAX_FILES_VIEW_COLUMNS = 10_000
"""The files view makes one column per distinct tensor name: past this many (a KV dataset
names a tensor per key) the view is refused in favour of ``kv`` or ``tensors``."""

FILE_VIEWS = ("tensors", "files")
"""Views that read any safetensors file, with or without a manifest."""

INDEX_ENTRY_TYPE = StructType(
    [StructField("dtype", StringType()), StructField("shape", ArrayType(LongType()))]
)
"""What the index view gives for each tensor column of a row: the tensor without its bytes."""

INDEX_ROWS_PER_PARTITION = 1 << 22
"""The index view of a batch dataset: rows per partition (made from the manifest alone)."""


_DTYPE, _SHAPE, _BEGIN, _END = (operator.itemgetter(i) for i in (1, 2, 3, 4))
"""A ``TensorInfo``'s fields, for bulk reads of a header's 10^5 entries."""


class ReadError(PysparkSafetensorsError, ValueError):
    """An input that cannot be read: missing, corrupt, or disagreeing with its manifest."""


@dataclass(frozen=True)
class Source:
    """What a path resolves to: a dataset with a manifest, or loose files; ``files`` are
    names inside ``location``."""

    location: DatasetLocation
    manifest: Manifest | None
    files: tuple[str, ...] = field(default=())
    sizes: tuple[int, ...] = field(default=())
    """Bytes of each file (what partitions are packed by)."""


def _glob(path: str, storage: Mapping[str, str]) -> Source:
    first = min(path.index(c) for c in "*?[" if c in path)
    base = path[: path.rfind("/", 0, first) + 1] if "/" in path[:first] else ""
    pattern = path[len(base) :]
    location = DatasetLocation.of(base.rstrip("/") or ".", storage_options=storage)
    recursive = "/" in pattern or "**" in pattern
    files = {
        name: info.size
        for name, info in sorted(location.list(recursive=recursive).items())
        if info.type == pafs.FileType.File
        and name.endswith(".safetensors")
        and fnmatch.fnmatchcase(name, pattern)
    }
    if not files:
        raise ReadError(f"{path!r}: no .safetensors files match")
    return Source(location, None, tuple(files), tuple(files.values()))


def resolve(options: ReaderOptions, storage: Mapping[str, str] | None = None) -> Source:
    """What ``options.path`` (the first path) resolves to."""
    return resolve_path(options.path, storage)


def resolve_path(path: str, storage: Mapping[str, str] | None = None) -> Source:
    """A dataset directory (or its manifest file), one ``.safetensors`` file, or a
    directory or glob of them; anything else is refused here, on the driver."""
    storage = storage or {}
    if path.rstrip("/").rpartition("/")[2] == MANIFEST:  # the manifest stands for its dataset
        path = path.rstrip("/")[: -len(MANIFEST)].rstrip("/") or "."
    if any(c in path for c in "*?["):
        return _glob(path, storage)
    location = DatasetLocation.of(path, storage_options=storage)
    listing = location.list()
    if MANIFEST in listing:
        manifest = load_manifest(location)
        manifest.refuse_partitioned(location.uri, "the Python source")
        problems = []
        for s in manifest.shards:
            info = listing.get(s.shard_path)
            if info is None:
                problems.append(f"{s.shard_path} is missing")
            elif info.type != pafs.FileType.File:
                problems.append(f"{s.shard_path} is not a regular file")
            elif info.size != s.bytes:
                problems.append(
                    f"size differs from the manifest: {s.shard_path} ({info.size} bytes, the manifest says {s.bytes})"
                )
        if problems:
            raise ReadError(
                f"dataset {location.uri!r} disagrees with its manifest: {'; '.join(problems[:5])}"
            )
        return Source(
            location,
            manifest,
            tuple(s.shard_path for s in manifest.shards),
            tuple(s.bytes for s in manifest.shards),
        )
    if listing:
        leftovers = sorted(n for n in listing if SHARD_NAME.match(n) or n == STAGING)
        if leftovers:
            raise ReadError(
                f"{location.uri!r} holds files of a dataset write that never committed "
                f"({', '.join(leftovers[:3])}, ...) and no {MANIFEST}: it is not a dataset. "
                "Rewrite it, or read the files anyway with a glob such as "
                f"'{location.uri.rstrip('/')}/*.safetensors'"
            )
        files = {
            name: info.size
            for name, info in sorted(location.list(recursive=True).items())
            if info.type == pafs.FileType.File
            and name.endswith(".safetensors")
            and not any(part.startswith(("_", ".")) for part in name.split("/"))
        }
        if not files:
            raise ReadError(f"{location.uri!r}: no dataset manifest and no .safetensors files")
        return Source(location, None, tuple(files), tuple(files.values()))
    single, name = location.parent()
    try:
        size = single.regular_size(name) if name else None
        if size is not None:
            if not name.endswith(".safetensors"):
                raise ReadError(
                    f"{location.uri!r} is a file but neither a .safetensors file nor a "
                    f"dataset's {MANIFEST}: give a dataset directory, a .safetensors file, or "
                    "a directory or glob of them"
                )
            read_header(single, name)  # a broken file is refused here, not in a task
            return Source(single, None, (name,), (size,))
    except (ManifestError, SafetensorsFormatError) as e:
        raise ReadError(str(e)) from None
    raise ReadError(f"{location.uri!r}: no such file or directory")


def default_view(source: Source, requested: str | None, infer_schema: bool = False) -> str:
    """The view asked for, checked against the source, or the default: the dataset's mode
    (``rows``/``kv``), and for plain files ``tensors`` — ``files`` with ``inferSchema``."""
    if source.manifest is None:
        if requested not in (None, *FILE_VIEWS):
            raise OptionError(
                f"view={requested!r} needs a dataset directory with {MANIFEST}; plain files "
                "support view=tensors (include_data=false: no tensor bytes) or view=files"
            )
        return requested or ("files" if infer_schema else "tensors")
    mode_view = "kv" if source.manifest.mode == "kv" else "rows"
    if requested is None:
        return mode_view
    if requested not in (*FILE_VIEWS, "index") and requested != mode_view:
        raise OptionError(
            f"view={requested!r} does not fit a {source.manifest.mode}-mode dataset; use view={mode_view}, index, tensors or files"
        )
    return requested


def _column_type(dtype: str, rank: int, tensor_format: str) -> DataType:
    if tensor_format == "struct":
        return TENSOR_STRUCT_TYPE
    t = READ_TYPES[dtype][0]
    for _ in range(rank):
        t = ArrayType(t)
    return t


def _files_schema(source: Source) -> StructType:
    """One nullable Tensor Struct column per tensor name of any file, sorted by name."""
    manifest = source.manifest
    if manifest is not None and manifest.mode != "kv" and manifest.schema:
        names = set(manifest.schema)  # every shard of a batch dataset holds these
    else:
        names = set()
        for file in source.files:
            names.update(t.name for t in read_header(source.location, file).tensors)
            if len(names) > MAX_FILES_VIEW_COLUMNS:
                raise OptionError(
                    f"view=files: {source.location.uri!r} holds over {MAX_FILES_VIEW_COLUMNS} "
                    "distinct tensor names, one column each; read it with view=kv (a KV "
                    "dataset: one row per key) or view=tensors (one row per tensor)"
                )
    return StructType([StructField(n, TENSOR_STRUCT_TYPE) for n in sorted(names)])


def infer_schema(source: Source, view: str, options: ReaderOptions) -> StructType:
    if view == "files":
        return _files_schema(source)
    if view == "tensors":
        fields = [
            StructField("file", StringType()),
            StructField("name", StringType()),
            StructField("dtype", StringType()),
            StructField("shape", ArrayType(LongType())),
        ]
        if options.include_data:
            fields.append(StructField("data", TENSOR_STRUCT_TYPE))
        return StructType(fields)
    manifest = source.manifest
    fields = []
    if manifest.mode == "kv" and view in ("kv", "index"):
        fields.append(StructField(manifest.name_col or "key", StringType()))
    if view == "index":
        fields += [StructField("file", StringType()), StructField("row", LongType())]
    for name, col in dataset_columns(source).items():
        t = (
            INDEX_ENTRY_TYPE
            if view == "index"
            else _column_type(col.dtype, len(col.sample_shape), options.tensor_format)
        )
        fields.append(StructField(name, t))
    return StructType(fields)


def dataset_columns(source: Source) -> dict[str, ColumnSchema]:
    """A dataset's columns: the manifest's schema, or (a manifest without one) the first
    shard's header."""
    schema = source.manifest.schema
    if not schema and source.manifest.shards:
        header = read_header(source.location, source.files[0])
        schema = {t.name: ColumnSchema(t.dtype.name, t.shape, t.shape[1:]) for t in header.tensors}
    return schema


# ------------------------------------------------------------------------ partitions

PARTITION_BYTES = 128 << 20
"""About how many bytes one read task reads: Spark's default
``spark.sql.files.maxPartitionBytes``. Consecutive shards (and row ranges of larger ones)
are packed into partitions of about this size, split evenly: each task costs a Python
worker's round trip (tens of milliseconds), so 20 shards of 10 MB read as 20 tasks took
1.5-2x as long as the same rows in 2. A Python source cannot learn the cluster's cores,
so where a small dataset should spread over many of them, ``rows_per_partition`` cuts
it finer."""

OPEN_COST_BYTES = 4 << 20
"""What a file counts for at least when files are packed (Spark's default
``spark.sql.files.openCostInBytes``), so header-only reads of many files still spread."""

BATCH_BYTES = 8 << 20
"""About how many tensor bytes one Arrow batch holds (at least one row or tensor)."""

MAX_BINARY_BYTES = 2**31 - 1
"""The most bytes one Spark binary value (a Tensor Struct's ``data``) can hold."""


@dataclass(frozen=True)
class ShardPartition(InputPartition):
    """Row ranges of consecutive shards of one loaded path, read in turn."""

    pieces: tuple[tuple[int, int, int], ...]
    """(position in the manifest's shard list, first row, row past the last); -1 for the
    shard's end."""
    source: int = 0
    """Which of the loaded paths."""


@dataclass(frozen=True)
class FilesPartition(InputPartition):
    files: tuple[str, ...]
    source: int = 0


def pack(weights: list[int], limit: int) -> list[list[int]]:
    """Consecutive items of the given weights grouped into about ``total / limit`` groups
    of even weight: an item starts a new group when adding it would pass the even share
    by more than half its own weight (so a heavy item is a group of its own)."""
    total = sum(weights)
    n = max(1, -(-total // limit))
    groups: list[list[int]] = [[]]
    filled = 0
    for i, w in enumerate(weights):
        if groups[-1] and (2 * filled + w) * n > 2 * total:
            groups.append([])
            filled = 0
        groups[-1].append(i)
        filled += w
    return groups if groups[0] else []


def cut_rows(counts: list[int], rows_per_part: int) -> list[tuple[tuple[int, int, int], ...]]:
    """Shards of ``counts`` rows cut into consecutive partitions of ``rows_per_part`` rows
    (the last may hold fewer); an empty shard rides along with its neighbours."""
    parts: list[list[tuple[int, int, int]]] = [[]]
    room = rows_per_part
    for shard, count in enumerate(counts):
        if count == 0:
            parts[-1].append((shard, 0, 0))
        start = 0
        while start < count:
            if room == 0:
                parts.append([])
                room = rows_per_part
            stop = min(count, start + room)
            parts[-1].append((shard, start, stop))
            room -= stop - start
            start = stop
    return [tuple(p) for p in parts if p]


class SafetensorsReader(DataSourceReader):
    """Reads one view of a source; filters are pushed only by ``PushdownSafetensorsReader``."""

    wanted_names: set[str] | None = None
    wanted_dtypes: set[str] | None = None
    wanted_keys: set[str] | None = None

    def __init__(
        self,
        options: ReaderOptions,
        sources: Source | tuple[Source, ...],
        view: str,
        schema: StructType,
        *,
        inferred: StructType | None = None,
    ):
        self.options = options
        self.sources = sources if isinstance(sources, tuple) else (sources,)
        """One per loaded path, all of one view and one schema."""
        self.view = view
        self.schema = schema
        if inferred is None:
            inferred = infer_schema(self.sources[0], view, options)
        missing = [f.name for f in schema.fields if f.name not in inferred.fieldNames()]
        if missing:
            raise ReadError(
                f"schema names column(s) {missing} that {options.path!r} does not have; it has {inferred.fieldNames()}"
            )
        for f in schema.fields:
            # simpleString ignores nullability: a schema that declares its fields not null
            # (the Scala connector's Tensor Struct does) reads the same data.
            if f.dataType.simpleString() != inferred[f.name].dataType.simpleString():
                raise ReadError(
                    f"column {f.name!r}: the given schema says {f.dataType.simpleString()}, the data is {inferred[f.name].dataType.simpleString()}"
                )
        # Spark checks returned batches against the schema's Arrow form, nullability
        # included: a schema declaring not-null fields gets batches cast to it.
        self._cast_to = None if schema == _nullable(schema) else _arrow_schema(schema)
        self._indexes: dict[int, ShardIndex] = {}
        """Each source's tensor index, read once in a task (never shipped: see below)."""

    def __getstate__(self):
        return {**self.__dict__, "_indexes": {}}

    @property
    def source(self) -> Source:
        """The first loaded path's source (settings every source shares)."""
        return self.sources[0]

    def partitions(self):
        parts = []
        for i, source in enumerate(self.sources):
            parts += self._partitions(source, i)
        return parts or [FilesPartition(())]

    def _partitions(self, source: Source, i: int) -> list[InputPartition]:
        if self.view in FILE_VIEWS:
            reads_data = self.view == "files" or "data" in self.schema.fieldNames()
            weights = [max(size if reads_data else 0, OPEN_COST_BYTES) for size in source.sizes]
            return [
                FilesPartition(tuple(source.files[j] for j in group), i)
                for group in pack(weights, PARTITION_BYTES)
            ]
        entries = source.manifest.shards
        if self.view == "index":
            return self._index_partitions(source, i)
        if self.view == "kv":
            return [
                ShardPartition(tuple((j, 0, -1) for j in group), i)
                for group in pack([e.bytes for e in entries], PARTITION_BYTES)
            ]
        counts = [e.samples_count for e in entries]
        step = self.options.rows_per_partition
        if step is not None:  # the user's ranges, one partition each
            return [
                ShardPartition(((j, a, min(a + step, n)),), i)
                for j, n in enumerate(counts)
                for a in range(0, max(n, 1), step)
            ]
        total_rows, total_bytes = sum(counts), sum(e.bytes for e in entries)
        n_parts = max(1, -(-total_bytes // PARTITION_BYTES))
        return [
            ShardPartition(pieces, i)
            for pieces in cut_rows(counts, max(1, -(-total_rows // n_parts)))
        ]

    def _index_partitions(self, source: Source, i: int) -> list[InputPartition]:
        entries = source.manifest.shards
        if source.manifest.mode != "kv":  # from the manifest alone
            counts = [e.samples_count for e in entries]
            return [ShardPartition(p, i) for p in cut_rows(counts, INDEX_ROWS_PER_PARTITION)]
        if source.manifest.index_file is not None:  # one read of the tensor index
            return [ShardPartition(tuple((j, 0, -1) for j in range(len(entries))), i)]
        return [  # headers only
            ShardPartition(tuple((j, 0, -1) for j in group), i)
            for group in pack([OPEN_COST_BYTES] * len(entries), PARTITION_BYTES)
        ]

    def read(self, partition) -> Iterator[pa.RecordBatch]:
        batches = self._read(partition)
        if self._cast_to is None:
            yield from batches
        else:
            yield from (b.cast(self._cast_to) for b in batches)

    def _read(self, partition) -> Iterator[pa.RecordBatch]:
        if self.view == "tensors":
            yield from self._read_tensors(partition)
        elif self.view == "files":
            yield from self._read_files(partition)
        elif self.view == "index" and isinstance(partition, ShardPartition):
            yield from self._read_index(partition)
        elif isinstance(partition, ShardPartition):
            for shard, start, stop in partition.pieces:
                if self.view == "rows":
                    yield from self._read_rows(partition.source, shard, start, stop)
                else:
                    yield from self._read_kv(partition.source, shard)

    # -- tensors view

    def _read_tensors(self, partition: FilesPartition):
        names = [f.name for f in self.schema.fields]
        location = self.sources[partition.source].location
        for file in partition.files:
            shown = location.display(file)
            if "data" in names:
                with open_shard(location, file, whole=True) as f:
                    infos = self._keep(f.header.tensors)
                    for a, b in _byte_chunks(infos, shown):
                        yield _batch(names, shown, infos[a:b], _structs_of(f, infos[a:b], shown))
            else:  # header only: no tensor byte is read
                yield _batch(names, shown, self._keep(read_header(location, file).tensors), None)

    # -- files view

    def _read_files(self, partition: FilesPartition):
        """One row per file: each schema column the file's tensor of that name, as it is
        stored (checked against the manifest entry when the file belongs to a dataset)."""
        source = self.sources[partition.source]
        entries = {e.shard_path: e for e in source.manifest.shards} if source.manifest else {}
        names = [f.name for f in self.schema.fields]
        for file in partition.files:
            with open_shard(source.location, file, whole=True) as f:
                entry = entries.get(file)
                problems = entry and check_shard(source.manifest, entry, entry.bytes, f.header)
                if problems:
                    raise ReadError(f"dataset {source.location.uri!r}: {'; '.join(problems[:5])}")
                row = [
                    pa.array(
                        [
                            _tensor_struct(f.raw(f.header[n]), f.header[n])
                            if n in f.header
                            else None
                        ],
                        type=TENSOR_STRUCT_ARROW,
                    )
                    for n in names
                ]
            yield pa.record_batch(row, names=names)

    def _keep(self, infos):
        if self.wanted_names is None and self.wanted_dtypes is None:
            return list(infos)
        return [
            t
            for t in infos
            if (self.wanted_names is None or t.name in self.wanted_names)
            and (self.wanted_dtypes is None or t.dtype.name in self.wanted_dtypes)
        ]

    # -- rows view

    def _open(self, source_index: int, shard: int, *, whole: bool = False):
        """A shard, its header checked against the manifest entry (the same check every
        reader runs: dtypes, sample shapes and the row count)."""
        source = self.sources[source_index]
        entry = source.manifest.shards[shard]
        location = source.location
        f = open_shard(location, entry.shard_path, whole=whole)
        problems = check_shard(source.manifest, entry, entry.bytes, f.header)
        if problems:
            f.close()
            raise ReadError(f"dataset {location.uri!r}: {'; '.join(problems[:5])}")
        return f, location.display(entry.shard_path)

    def _read_rows(self, source_index: int, shard: int, start: int, stop: int):
        """Rows ``[start, stop)`` of one shard, in batches of about ``BATCH_BYTES``."""
        f, file = self._open(source_index, shard)
        with f:
            header = f.header
            expected_schema = self.sources[source_index].manifest.schema
            names = [fld.name for fld in self.schema.fields]
            entry_rows = None
            for name in names:
                if name not in header:
                    raise ReadError(
                        f"file {file!r}: no tensor {name!r}, which the dataset schema lists"
                    )
                info = header[name]
                expected = expected_schema.get(name)
                if expected is not None and (
                    info.dtype.name != expected.dtype
                    or tuple(info.shape[1:]) != tuple(expected.sample_shape)
                ):
                    raise ReadError(
                        f"file {file!r}: tensor {name!r} is {info.dtype}{list(info.shape)}, the manifest says {expected.dtype}[*, {', '.join(map(str, expected.sample_shape))}]"
                    )
                rows = info.shape[0] if info.shape else 1
                entry_rows = rows if entry_rows is None else entry_rows
                if rows != entry_rows:
                    raise ReadError(
                        f"file {file!r}: tensor {name!r} has {rows} rows, others have {entry_rows}"
                    )
            rows = entry_rows or 0
            stop = rows if stop < 0 else min(stop, rows)
            row_bytes = sum(header[n].nbytes for n in names) // max(rows, 1)
            step = max(1, BATCH_BYTES // max(row_bytes, 1))
            for a in range(start, stop, step):
                b = min(a + step, stop)
                columns = []
                for name in names:
                    info = header[name]
                    chunk = f.row_range(name, a, b) if info.shape else f.tensor(name)
                    if self.options.tensor_format == "struct":
                        columns.append(_struct_rows(chunk, info.dtype.name))
                    else:
                        columns.append(
                            _uniform_lists(
                                _convert(chunk, info.dtype.name, file, name), chunk.ndim - 1
                            )
                        )
                yield pa.record_batch(columns, names=names)

    # -- kv view

    def _read_kv(self, source_index: int, shard: int):
        """One shard's keys with their tensors, in batches of about ``BATCH_BYTES``: the
        tensors' names, dtypes, shapes and places from the tensor index when the dataset
        has one (as the torch reader takes them; no header of 10^5 entries parsed), else
        from the header, decoded in bulk; names split in bulk, rows in the file's order of
        the first column, whose tensors are then one run of the mapped bytes (other
        columns' are copied when they lie otherwise)."""
        source = self.sources[source_index]
        manifest = source.manifest
        key_col = manifest.name_col or "key"
        sep = manifest.kv_separator or "__"
        names = [f.name for f in self.schema.fields]
        f, file, header = self._open_kv(source_index, shard)
        with f:
            columns = [n for n in names if n != key_col]
            keys, positions = _kv_rows(
                _arrow_names(header), list(manifest.schema), columns, sep, file, self.wanted_keys
            )
            out = {key_col: keys}
            sizes = np.zeros(len(keys), dtype=np.int64)
            for col in columns:
                out[col], nbytes = _kv_column(
                    f,
                    header,
                    positions[col],
                    col,
                    file,
                    manifest.schema[col],
                    self.options.tensor_format,
                )
                sizes += nbytes
            batch = pa.record_batch([out[n] for n in names], names=names)
            for a, b in _row_chunks(sizes):
                yield batch.slice(a, b - a)

    def _open_kv(self, source_index: int, shard: int):
        """A KV shard to read whole: (its bytes, its display name, its tensors as header
        columns with ``data_start`` set on the bytes)."""
        source = self.sources[source_index]
        manifest, location = source.manifest, source.location
        if manifest.index_file is None:
            f, file = self._open(source_index, shard, whole=True)
            return f, file, f.header.columns
        entry = manifest.shards[shard]
        try:
            if source_index not in self._indexes:  # the index file read once per task
                self._indexes[source_index] = ShardIndex(location, manifest)
            rows = self._indexes[source_index].rows(entry.shard_path)
        except ManifestError as e:
            raise ReadError(str(e)) from None
        f = open_shard_bytes(location, entry.shard_path)
        try:
            problems = check_shard(manifest, entry, f.size, None)
            if problems:
                raise ReadError(f"dataset {location.uri!r}: {'; '.join(problems)}")
            header = shard_columns(rows, f.data_start, location.display(manifest.index_file))
        except ManifestError as e:
            f.close()
            raise ReadError(str(e)) from None
        except BaseException:
            f.close()
            raise
        return f, location.display(entry.shard_path), header

    # -- index view

    def _read_index(self, part: ShardPartition):
        """The rows of the data view without their bytes: a batch dataset's from its
        manifest (no shard opened), a KV dataset's from its tensor index (no shard opened)
        or, without one, from its shards' headers."""
        source = self.sources[part.source]
        manifest, location = source.manifest, source.location
        names = [f.name for f in self.schema.fields]
        key_col = manifest.name_col or "key"
        columns = [n for n in names if n not in ("file", "row") and n != key_col]
        if manifest.mode != "kv":
            schema = dataset_columns(source)
            for shard, start, stop in part.pieces:
                entry = manifest.shards[shard]
                stop = entry.samples_count if stop < 0 else stop
                n = stop - start
                out = {
                    "file": repeated_string(location.display(entry.shard_path), n),
                    "row": pa.array(np.arange(start, stop, dtype=np.int64)),
                }
                for col in columns:
                    sample = np.array(schema[col].sample_shape, dtype=np.int64)
                    shapes = pa.ListArray.from_arrays(
                        pa.array(np.arange(n + 1, dtype=np.int32) * len(sample)),
                        pa.array(np.tile(sample, n), pa.int64()),
                    )
                    out[col] = _index_entries(repeated_string(schema[col].dtype, n), shapes)
                yield pa.record_batch([out[c] for c in names], names=names)
            return
        table = None
        if manifest.index_file is not None:
            try:
                table = read_index(location, manifest)
            except ManifestError as e:
                raise ReadError(str(e)) from None
        sep = manifest.kv_separator or "__"
        for shard, _, _ in part.pieces:
            entry = manifest.shards[shard]
            file = location.display(entry.shard_path)
            if table is not None:
                rows = table.filter(pc.equal(table["file_name"], entry.shard_path))
                tensor_names = rows["tensor_key"].combine_chunks()
                dtypes = rows["dtype"].combine_chunks()
                shapes = rows["shape"].combine_chunks().cast(pa.list_(pa.int64()))
            else:
                header = read_header(location, entry.shard_path, entry.bytes).columns
                tensor_names = _arrow_names(header)
                dtypes = pa.array([d.name for d in header.dtypes], pa.string()).take(
                    header.dtype_of
                )
                shapes = pa.array([list(s) for s in header.shapes], pa.list_(pa.int64()))
                shapes = shapes.take(header.shape_of)
            keys, positions = _kv_rows(
                tensor_names, list(manifest.schema), columns, sep, file, self.wanted_keys
            )
            out = {
                key_col: keys,
                "file": repeated_string(file, len(keys)),
                "row": pa.array(np.arange(len(keys), dtype=np.int64)),
            }
            for col in columns:
                out[col] = _index_entries(dtypes.take(positions[col]), shapes.take(positions[col]))
            yield pa.record_batch([out[c] for c in names], names=names)


class PushdownSafetensorsReader(SafetensorsReader):
    """The reader when ``spark.sql.python.filterPushdown.enabled`` is on (Spark >= 4.1
    refuses a reader that implements ``pushFilters`` while the setting is off)."""

    def pushFilters(self, filters):
        """Push name/dtype (tensors view) and key (KV view) equality filters."""
        from pyspark.sql.datasource import EqualTo, In  # Spark 4.1+, as this reader

        key_col = self.source.manifest.name_col if self.source.manifest else None
        for f in filters:
            column = f.attribute[0] if len(f.attribute) == 1 else None
            values = (
                [f.value]
                if isinstance(f, EqualTo)
                else list(f.value)
                if isinstance(f, In)
                else None
            )
            if values is None or not all(isinstance(v, str) for v in values):
                yield f
            elif self.view == "tensors" and column == "name":
                self.wanted_names = set(values) & (self.wanted_names or set(values))
            elif self.view == "tensors" and column == "dtype":
                self.wanted_dtypes = set(values) & (self.wanted_dtypes or set(values))
            elif self.view in ("kv", "index") and key_col and column == key_col:
                self.wanted_keys = set(values) & (self.wanted_keys or set(values))
            else:
                yield f


def _nullable(t: DataType) -> DataType:
    """``t`` with every field and element nullable (what the views produce)."""
    if isinstance(t, StructType):
        return StructType([StructField(f.name, _nullable(f.dataType)) for f in t.fields])
    if isinstance(t, ArrayType):
        return ArrayType(_nullable(t.elementType))
    return t


def _arrow_schema(schema: StructType) -> pa.Schema:
    from pyspark.sql.pandas.types import to_arrow_schema

    return to_arrow_schema(schema, timezone="UTC")


def _convert(t: np.ndarray, dtype: str, file: str, column: str) -> np.ndarray:
    target = READ_TYPES[dtype][1]
    if dtype == "U64" and t.size and t.max() > np.iinfo(np.int64).max:
        raise ReadError(
            f"file {file!r}: column {column!r} holds U64 values above 2^63-1, which Spark's long cannot hold"
        )
    return t.astype(target, copy=False) if t.dtype != target else t


def _uniform_lists(values: np.ndarray, rank: int) -> pa.Array:
    """``values`` of shape [rows, *sample] as nested Arrow lists (zero-copy offsets)."""
    arr = pa.array(np.ascontiguousarray(values).reshape(-1))
    shape = values.shape
    for depth in range(rank, 0, -1):
        n_lists = math.prod(shape[:depth])
        offsets = pa.array(np.arange(n_lists + 1, dtype=np.int32) * shape[depth])
        arr = pa.ListArray.from_arrays(offsets, arr)
    return arr


def _kv_rows(names: pa.StringArray, schema_columns, requested, sep: str, file: str, wanted_keys):
    """A KV shard's keys (as Arrow strings; only ``wanted_keys`` when given), in the order
    the first requested column's tensors lie in the file, and for each requested column
    the positions in ``names`` (the shard's tensor names) of its tensors in that order.
    Names are split by ``split_kv_name``'s rule (the longest column suffix wins), in
    bulk."""
    owner = np.full(len(names), -1, dtype=np.int64)
    for c in sorted(range(len(schema_columns)), key=lambda c: -len(schema_columns[c])):
        hit = pc.ends_with(names, kv_suffix(schema_columns[c], sep))
        owner[hit.to_numpy(zero_copy_only=False) & (owner < 0)] = c
    if (owner < 0).any():
        bad = names[int(np.argmax(owner < 0))].as_py()
        raise ReadError(
            f"file {file!r}: tensor {bad!r} is not '<key>{sep}<column>' for a column of the dataset"
        )
    wanted = None if wanted_keys is None else pa.array(sorted(wanted_keys), pa.string())
    keyed = {}
    for c, col in enumerate(schema_columns):
        where = np.flatnonzero(owner == c)
        keys = pc.utf8_slice_codeunits(names.take(where), 0, -len(kv_suffix(col, sep)))
        if wanted is not None:
            keep = pc.is_in(keys, value_set=wanted)
            where, keys = where[keep.to_numpy(zero_copy_only=False)], keys.filter(keep)
        order = pc.sort_indices(keys).to_numpy()
        keyed[col] = (keys.take(order), where[order])
    every = [k for k, _ in keyed.values()]
    union = every[0] if every else pa.array([], pa.string())
    if any(not k.equals(union) for k in every[1:]):
        union = pc.unique(pa.concat_arrays(every))
        union = union.take(pc.sort_indices(union))
    for col in requested:
        keys = keyed[col][0]
        if not keys.equals(union):
            missing = pc.filter(union, pc.invert(pc.is_in(union, value_set=keys)))[0].as_py()
            raise ReadError(f"file {file!r}: key {missing!r} has no tensor for column {col!r}")
    positions = {col: keyed[col][1] for col in requested}
    if requested:  # rows in the file's order of the first column: its bytes stay one run
        order = np.argsort(positions[requested[0]], kind="stable")
        union = union.take(order)
        positions = {col: p[order] for col, p in positions.items()}
    return union, positions


def _index_entries(dtypes: pa.Array, shapes: pa.Array) -> pa.StructArray:
    return pa.StructArray.from_arrays([dtypes, shapes], names=["dtype", "shape"])


def _arrow_names(header: HeaderColumns) -> pa.StringArray:
    """A header's tensor names as Arrow strings, over its name bytes."""
    return pa.StringArray.from_buffers(
        len(header),
        pa.py_buffer(header.name_offsets.astype(np.int32)),
        pa.py_buffer(header.name_data),
    )


def _gather(f, infos) -> tuple[np.ndarray, np.ndarray]:
    """The bytes of ``infos``' tensors one after another (a view of the shard when they
    lie so in the file, else a copy) and each one's byte count."""
    begins = np.fromiter(map(_BEGIN, infos), np.int64, len(infos))
    ends = np.fromiter(map(_END, infos), np.int64, len(infos))
    return _gather_ranges(f, begins, ends)


def _gather_ranges(f, begins: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``_gather`` of the tensors at ``[begins[i], ends[i])`` of the byte buffer."""
    if not len(begins):
        return np.empty(0, np.uint8), np.empty(0, np.int64)
    base = f.data_start
    if (begins[1:] == ends[:-1]).all():
        data = f.byte_range(base + int(begins[0]), base + int(ends[-1]))
        return np.frombuffer(data, np.uint8), ends - begins
    data = np.frombuffer(f.byte_range(base, base + int(ends.max())), np.uint8)
    pieces = [data[a:b] for a, b in zip(begins.tolist(), ends.tolist(), strict=True)]
    return np.concatenate(pieces), ends - begins


def _kv_column(
    f,
    header: HeaderColumns,
    rows: np.ndarray,
    column: str,
    file: str,
    expected: ColumnSchema,
    tensor_format: str,
):
    """One KV column's tensors (``header``'s tensors ``rows``, one per row, in row order)
    as an Arrow array, and each row's bytes; worked on the header's columns."""
    rank = len(expected.sample_shape)
    shape_of = header.shape_of[rows]
    used = np.unique(shape_of).tolist()
    wrong = [s for s in used if len(header.shapes[s]) != rank]
    if wrong:
        i = int(np.flatnonzero(np.isin(shape_of, wrong))[0])
        raise ReadError(
            f"file {file!r}: tensor {header.name(int(rows[i]))!r} has shape "
            f"{list(header.shapes[shape_of[i]])}, the manifest gives column {column!r} "
            f"{rank} dimension(s)"
        )
    dtype_of = header.dtype_of[rows]
    dtypes = [header.dtypes[d] for d in np.unique(dtype_of).tolist()]
    raw, nbytes = _gather_ranges(f, header.begins[rows], header.ends[rows])
    table = np.zeros((len(header.shapes), rank), dtype=np.int64)
    for s in used:
        table[s] = header.shapes[s]
    dims = table[shape_of]
    if tensor_format == "struct":
        dtype_names = (
            dtypes[0].name
            if len(dtypes) == 1
            else pa.array([d.name for d in header.dtypes], pa.string()).take(dtype_of)
        )
        return _structs(
            raw,
            nbytes,
            dims.reshape(-1),
            np.full(len(rows), rank, dtype=np.int64),
            dtype_names,
            lambda i: (header.name(int(rows[i])), header.shapes[shape_of[i]]),
            file,
        ), nbytes
    if len(dtypes) > 1:  # mixed dtypes in one column: each tensor converted on its own
        bounds = np.concatenate([[0], np.cumsum(nbytes)]).tolist()
        flat = np.concatenate(
            [
                _convert(
                    raw[a:b].view(header.dtypes[d].numpy or np.uint8),
                    header.dtypes[d].name,
                    file,
                    column,
                )
                for a, b, d in zip(bounds, bounds[1:], dtype_of.tolist(), strict=False)
            ]
        )
    elif dtypes:
        dtype = dtypes[0]
        flat = _convert(raw.view(dtype.numpy), dtype.name, file, column)
    else:
        flat = np.empty(0, READ_TYPES[expected.dtype][1])
    if len(used) == 1:  # one shape for every row (the common case): no per-row dims
        return _uniform_lists(flat.reshape(len(rows), *header.shapes[used[0]]), rank), nbytes
    return _nested_lists(flat, dims), nbytes


def _dtypes(infos) -> list:
    """The distinct dtypes of ``infos`` (by identity: a header's entries share the
    table's dtype objects, and hashing 10^5 dataclasses costs more than the read)."""
    return list({id(d): d for d in map(_DTYPE, infos)}.values())


def _nested_lists(values: np.ndarray, dims: np.ndarray) -> pa.Array:
    """Row i's values (``prod(dims[i])`` of them, rows one after another) as nested lists
    of shape ``dims[i]``; offsets computed in bulk."""
    n, rank = dims.shape
    if rank == 0:
        return pa.array(values)
    if n and (dims == dims[0]).all():
        return _uniform_lists(values.reshape(n, *dims[0].tolist()), rank)
    arr = pa.array(values)
    for depth in range(rank - 1, -1, -1):
        # lists at this depth: per row, prod(dims[:depth]) lists of length dims[depth]
        lengths = np.repeat(dims[:, depth], np.prod(dims[:, :depth], axis=1))
        offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
        np.cumsum(lengths, out=offsets[1:])
        arr = pa.ListArray.from_arrays(pa.array(offsets), arr)
    return arr


def _structs(raw: np.ndarray, nbytes: np.ndarray, dims, ranks, dtype_names, describe, file):
    """Tensor Structs over ``raw`` (the tensors' bytes one after another): tensor ``i``
    has ``ranks[i]`` dimensions (``dims``, every tensor's one after another) and dtype
    ``dtype_names`` (one name, or an Arrow string per tensor); ``describe(i)`` gives
    its name and shape for errors."""
    n = len(ranks)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(nbytes, out=offsets[1:])
    if offsets[-1] > MAX_BINARY_BYTES:  # callers cut batches below this
        raise ReadError(f"file {file!r}: over 2 GiB of tensors in one batch")
    data = pa.Array.from_buffers(
        pa.binary(), n, [None, pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(raw)]
    )
    if (dims > MAX_DIMENSION).any():
        bad = int(np.repeat(np.arange(n), ranks)[np.argmax(dims > MAX_DIMENSION)])
        name, shape = describe(bad)
        try:
            struct_shape(shape, f"tensor {name!r}")
        except TensorStructError as e:
            raise ReadError(str(e)) from None
    shape_offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(ranks, out=shape_offsets[1:])
    shape_lists = pa.ListArray.from_arrays(
        pa.array(shape_offsets), pa.array(dims.astype(np.int32), pa.int32())
    )
    return assemble_tensor_structs(data, shape_lists, dtype_names)


def _structs_of(f, infos, file: str) -> pa.Array:
    """The tensors' Tensor Structs (one Arrow buffer over the shard where they lie in
    file order, as a whole file's tensors do)."""
    raw, nbytes = _gather(f, infos)
    shapes = list(map(_SHAPE, infos))
    ranks = np.fromiter(map(len, shapes), np.int64, len(infos))
    dims = np.fromiter((d for s in shapes for d in s), np.int64, int(ranks.sum()))
    dtypes = _dtypes(infos)
    dtype_names = (
        dtypes[0].name if len(dtypes) == 1 else pa.array([t.dtype.name for t in infos], pa.string())
    )
    return _structs(
        raw, nbytes, dims, ranks, dtype_names, lambda i: (infos[i].name, infos[i].shape), file
    )


def _row_chunks(sizes: np.ndarray) -> list[tuple[int, int]]:
    """Consecutive ranges of rows of the given byte sizes holding about ``BATCH_BYTES``
    each (at least one row; one empty range when there is no row)."""
    n = len(sizes)
    if n == 0:
        return [(0, 0)]
    cum = np.cumsum(sizes)
    bounds = [0]
    while bounds[-1] < n:
        base = int(cum[bounds[-1] - 1]) if bounds[-1] else 0
        nxt = int(np.searchsorted(cum, base + BATCH_BYTES, side="right"))
        bounds.append(min(n, max(nxt, bounds[-1] + 1)))
    return list(itertools.pairwise(bounds))


def _byte_chunks(infos, file: str) -> list[tuple[int, int]]:
    """The tensors view's batches of a file; a tensor too large for one Spark value is
    refused, naming it."""
    nbytes = np.fromiter((t.end - t.begin for t in infos), np.int64, len(infos))
    if (nbytes > MAX_BINARY_BYTES).any():
        bad = infos[int(np.argmax(nbytes > MAX_BINARY_BYTES))]
        raise ReadError(
            f"file {file!r}: tensor {bad.name!r} holds {bad.end - bad.begin} bytes, more than one "
            "Spark value (2 GiB); list it with include_data=false"
        )
    return [] if not infos else _row_chunks(nbytes)


def _tensor_struct(raw: memoryview, info) -> dict:
    """One stored tensor as a Tensor Struct value (its bytes as they are)."""
    try:
        shape = struct_shape(info.shape, f"tensor {info.name!r}")
    except TensorStructError as e:
        raise ReadError(str(e)) from None
    return {"data": bytes(raw), "shape": shape, "dtype": info.dtype.name}


def _struct_rows(chunk: np.ndarray, dtype: str) -> pa.Array:
    """The rows of a batch-mode tensor as Tensor Structs, over its buffer."""
    try:
        return tensor_structs_of_rows(chunk, dtype)
    except TensorStructError as e:
        raise ReadError(str(e)) from None


def _batch(names, file, infos, data) -> pa.RecordBatch:
    cols = {
        "file": pa.array([file] * len(infos), pa.string()),
        "name": pa.array([t.name for t in infos], pa.string()),
        "dtype": pa.array([t.dtype.name for t in infos], pa.string()),
        "shape": pa.array([list(t.shape) for t in infos], pa.list_(pa.int64())),
    }
    if data is not None:
        cols["data"] = data
    return pa.record_batch([cols[n] for n in names], names=names)


@dataclass
class ReadPlan:
    """What a read resolved to on the driver: the sources (manifests loaded, shards
    stat-ed), the view and the inferred schema. Made once by ``DataSource.schema()`` and
    reused by ``reader()`` while every manifest is unchanged."""

    options: ReaderOptions
    sources: tuple[Source, ...]
    view: str
    schema: StructType

    def is_current(self) -> bool:
        """Whether the datasets are still what this plan saw (one manifest read each; a
        DataFrame may run long after it was loaded). Loose files are always listed again."""
        for source in self.sources:
            if source.manifest is None:
                return False
            try:
                if load_manifest(source.location) != source.manifest:
                    return False
            except (ManifestError, OSError):
                return False  # planning again raises the error with its message
        return True

    def reader(self, schema: StructType) -> SafetensorsReader:
        """The reader of ``schema`` (the inferred one or the user's, checked against it).
        Plain files read with a given schema of Tensor Struct columns (the Scala
        connector's way) take the files view unless a view was asked for."""
        cls = PushdownSafetensorsReader if pushdown_enabled() else SafetensorsReader
        view, inferred = self.view, self.schema
        if view == "tensors" and self.options.view is None and _names_tensors(schema, inferred):
            view, inferred = "files", infer_schema(self.sources[0], "files", self.options)
        return cls(self.options, self.sources, view, schema, inferred=inferred)


def _names_tensors(schema: StructType, tensors_view: StructType) -> bool:
    """Whether a given schema is of Tensor Struct columns named otherwise than the tensors
    view's columns."""
    return bool(schema.fields) and all(
        f.name not in tensors_view.fieldNames() and is_tensor_struct(f.dataType)
        for f in schema.fields
    )


def plan_read(options_map: Mapping[str, str]) -> ReadPlan:
    """Resolve every path of a read (storage options split off), on the driver: each must
    be readable with one view and give one schema."""
    storage, rest = split_storage_options(options_map)
    options = ReaderOptions.parse(rest)
    sources, view, inferred = [], None, None
    for path in options.paths:
        try:
            source = resolve_path(path, storage)
        except ManifestError as e:
            raise ReadError(str(e)) from None
        this_view = default_view(source, options.view, options.infer_schema)
        this_schema = infer_schema(source, this_view, options)
        if sources and (this_view, this_schema) != (view, inferred):
            raise ReadError(
                _disagreement(options.paths[0], path, (view, inferred), (this_view, this_schema))
            )
        sources.append(source)
        view, inferred = this_view, this_schema
    return ReadPlan(options, tuple(sources), view, inferred)


def make_reader(
    options_map: Mapping[str, str], schema: StructType | None
) -> tuple[StructType, SafetensorsReader | None]:
    """(the inferred schema, a reader of ``schema`` or None when it is None)."""
    plan = plan_read(options_map)
    return plan.schema, plan.reader(schema) if schema is not None else None


def _disagreement(first: str, other: str, a, b) -> str:
    """Why two loaded paths cannot be one DataFrame."""
    (view_a, schema_a), (view_b, schema_b) = a, b
    why = (
        f"{first!r} is read as view={view_a}, {other!r} as view={view_b}"
        if view_a != view_b
        else _schema_difference(first, other, schema_a, schema_b)
    )
    return (
        f"the loaded paths cannot be read as one DataFrame: {why}. Load paths of one schema "
        "together, or load them one by one and combine the DataFrames (unionByName)"
    )


def _schema_difference(first: str, other: str, a: StructType, b: StructType) -> str:
    for fa, fb in zip(a.fields, b.fields, strict=False):
        if fa.name != fb.name:
            return f"column {fa.name!r} of {first!r} is {fb.name!r} in {other!r}"
        if fa.dataType != fb.dataType:
            return (
                f"column {fa.name!r} is {fa.dataType.simpleString()} in {first!r} and "
                f"{fb.dataType.simpleString()} in {other!r}"
            )
    return f"{first!r} has columns {a.fieldNames()}, {other!r} has {b.fieldNames()}"


__all__ = [
    "ReadError",
    "ReadPlan",
    "ReaderOptions",
    "SafetensorsReader",
    "make_reader",
    "plan_read",
]
