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
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
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
    load_manifest,
    open_shard,
    read_header,
    split_kv_name,
    split_storage_options,
)
from ..dataset.layout import SHARD_NAME
from ..dataset.verify import check_shard
from ..format.errors import PysparkSafetensorsError, SafetensorsFormatError
from .compat import pushdown_enabled
from .dtypes import READ_TYPES
from .options import OptionError, ReaderOptions
from .tensor_struct import (
    TENSOR_STRUCT_ARROW,
    TENSOR_STRUCT_TYPE,
    TensorStructError,
    is_tensor_struct,
    struct_shape,
    tensor_structs_of_rows,
)

TENSORS_VIEW_PARTITIONS = 64
"""The tensors and files views group their files into about this many partitions (files
are small: one task per file would cost more than reading it)."""

MAX_FILES_VIEW_COLUMNS = 10_000
"""The files view makes one column per distinct tensor name: past this many (a KV dataset
names a tensor per key) the view is refused in favour of ``kv`` or ``tensors``."""

FILE_VIEWS = ("tensors", "files")
"""Views that read any safetensors file, with or without a manifest."""


class ReadError(PysparkSafetensorsError, ValueError):
    """An input that cannot be read: missing, corrupt, or disagreeing with its manifest."""


@dataclass(frozen=True)
class Source:
    """What a path resolves to: a dataset with a manifest, or loose files; ``files`` are
    names inside ``location``."""

    location: DatasetLocation
    manifest: Manifest | None
    files: tuple[str, ...] = field(default=())


def _glob(path: str, storage: Mapping[str, str]) -> Source:
    first = min(path.index(c) for c in "*?[" if c in path)
    base = path[: path.rfind("/", 0, first) + 1] if "/" in path[:first] else ""
    pattern = path[len(base) :]
    location = DatasetLocation.of(base.rstrip("/") or ".", storage_options=storage)
    recursive = "/" in pattern or "**" in pattern
    files = sorted(
        name
        for name, info in location.list(recursive=recursive).items()
        if info.type == pafs.FileType.File
        and name.endswith(".safetensors")
        and fnmatch.fnmatchcase(name, pattern)
    )
    if not files:
        raise ReadError(f"{path!r}: no .safetensors files match")
    return Source(location, None, tuple(files))


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
        return Source(location, manifest, tuple(s.shard_path for s in manifest.shards))
    if listing:
        leftovers = sorted(n for n in listing if SHARD_NAME.match(n) or n == STAGING)
        if leftovers:
            raise ReadError(
                f"{location.uri!r} holds files of a dataset write that never committed "
                f"({', '.join(leftovers[:3])}, ...) and no {MANIFEST}: it is not a dataset. "
                "Rewrite it, or read the files anyway with a glob such as "
                f"'{location.uri.rstrip('/')}/*.safetensors'"
            )
        files = sorted(
            name
            for name, info in location.list(recursive=True).items()
            if info.type == pafs.FileType.File
            and name.endswith(".safetensors")
            and not any(part.startswith(("_", ".")) for part in name.split("/"))
        )
        if not files:
            raise ReadError(f"{location.uri!r}: no dataset manifest and no .safetensors files")
        return Source(location, None, tuple(files))
    single, name = location.parent()
    try:
        if name and single.regular_size(name) is not None:
            if not name.endswith(".safetensors"):
                raise ReadError(
                    f"{location.uri!r} is a file but neither a .safetensors file nor a "
                    f"dataset's {MANIFEST}: give a dataset directory, a .safetensors file, or "
                    "a directory or glob of them"
                )
            read_header(single, name)  # a broken file is refused here, not in a task
            return Source(single, None, (name,))
    except (ManifestError, SafetensorsFormatError) as e:
        raise ReadError(str(e)) from None
    raise ReadError(f"{location.uri!r}: no such file or directory")


def default_view(source: Source, requested: str | None, infer_schema: bool = False) -> str:
    """The view asked for, checked against the source, or the default: the dataset's mode
    (``rows``/``kv``), and for plain files ``tensors`` — ``files`` with ``inferSchema``."""
    if source.manifest is None:
        if requested not in (None, *FILE_VIEWS):
            raise OptionError(
                f"view={requested!r} needs a dataset directory with {MANIFEST}; plain files support view=tensors or view=files"
            )
        return requested or ("files" if infer_schema else "tensors")
    mode_view = "kv" if source.manifest.mode == "kv" else "rows"
    if requested is None:
        return mode_view
    if requested not in FILE_VIEWS and requested != mode_view:
        raise OptionError(
            f"view={requested!r} does not fit a {source.manifest.mode}-mode dataset; use view={mode_view}, tensors or files"
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
    schema = manifest.schema
    if not schema and manifest.shards:  # a manifest without a schema: take the first header
        header = read_header(source.location, source.files[0])
        schema = {t.name: ColumnSchema(t.dtype.name, t.shape, t.shape[1:]) for t in header.tensors}
    fields = []
    if view == "kv":
        fields.append(StructField(manifest.name_col or "key", StringType()))
    for name, col in schema.items():
        fields.append(
            StructField(name, _column_type(col.dtype, len(col.sample_shape), options.tensor_format))
        )
    return StructType(fields)


# ------------------------------------------------------------------------ partitions


@dataclass(frozen=True)
class ShardPartition(InputPartition):
    shard: int
    """Position in the manifest's shard list."""
    row_start: int = 0
    row_stop: int = -1
    source: int = 0
    """Which of the loaded paths."""


@dataclass(frozen=True)
class FilesPartition(InputPartition):
    files: tuple[str, ...]
    source: int = 0


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
            per = max(1, len(source.files) // TENSORS_VIEW_PARTITIONS)
            return [
                FilesPartition(source.files[a : a + per], i)
                for a in range(0, len(source.files), per)
            ]
        parts = []
        step = self.options.rows_per_partition
        for shard, entry in enumerate(source.manifest.shards):
            if self.view == "kv" or entry.samples_count <= step:
                parts.append(ShardPartition(shard, source=i))
            else:
                parts += [
                    ShardPartition(shard, a, min(a + step, entry.samples_count), i)
                    for a in range(0, entry.samples_count, step)
                ]
        return parts

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
        elif isinstance(partition, ShardPartition):
            yield from (
                self._read_rows(partition) if self.view == "rows" else self._read_kv(partition)
            )

    # -- tensors view

    def _read_tensors(self, partition: FilesPartition):
        names = [f.name for f in self.schema.fields]
        location = self.sources[partition.source].location
        for file in partition.files:
            shown = location.display(file)
            if "data" in names:
                with open_shard(location, file, whole=True) as f:
                    infos = self._keep(f.header.tensors)
                    data = [_tensor_struct(f.raw(t), t) for t in infos]
                    yield _batch(names, shown, infos, data)
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
        return [
            t
            for t in infos
            if (self.wanted_names is None or t.name in self.wanted_names)
            and (self.wanted_dtypes is None or t.dtype.name in self.wanted_dtypes)
        ]

    # -- rows view

    def _open(self, part: ShardPartition, *, whole: bool = False):
        """The partition's shard, its header checked against the manifest entry (the
        same check every reader runs: dtypes, sample shapes and the row count)."""
        source = self.sources[part.source]
        entry = source.manifest.shards[part.shard]
        location = source.location
        f = open_shard(location, entry.shard_path, whole=whole)
        problems = check_shard(source.manifest, entry, entry.bytes, f.header)
        if problems:
            f.close()
            raise ReadError(f"dataset {location.uri!r}: {'; '.join(problems[:5])}")
        return f, location.display(entry.shard_path)

    def _read_rows(self, part: ShardPartition):
        f, file = self._open(part)
        with f:
            header = f.header
            entry_rows = None
            columns = []
            for fld in self.schema.fields:
                if fld.name not in header:
                    raise ReadError(
                        f"file {file!r}: no tensor {fld.name!r}, which the dataset schema lists"
                    )
                info = header[fld.name]
                expected = self.sources[part.source].manifest.schema.get(fld.name)
                if expected is not None and (
                    info.dtype.name != expected.dtype
                    or tuple(info.shape[1:]) != tuple(expected.sample_shape)
                ):
                    raise ReadError(
                        f"file {file!r}: tensor {fld.name!r} is {info.dtype}{list(info.shape)}, the manifest says {expected.dtype}[*, {', '.join(map(str, expected.sample_shape))}]"
                    )
                rows = info.shape[0] if info.shape else 1
                entry_rows = rows if entry_rows is None else entry_rows
                if rows != entry_rows:
                    raise ReadError(
                        f"file {file!r}: tensor {fld.name!r} has {rows} rows, others have {entry_rows}"
                    )
                stop = rows if part.row_stop < 0 else part.row_stop
                chunk = (
                    f.row_range(fld.name, part.row_start, stop)
                    if info.shape
                    else f.tensor(fld.name)
                )
                if self.options.tensor_format == "struct":
                    columns.append(_struct_rows(chunk, info.dtype.name))
                else:
                    columns.append(
                        _uniform_lists(
                            _convert(chunk, info.dtype.name, file, fld.name), chunk.ndim - 1
                        )
                    )
            yield pa.record_batch(columns, names=[fld.name for fld in self.schema.fields])

    # -- kv view

    def _read_kv(self, part: ShardPartition):
        manifest = self.sources[part.source].manifest
        key_col = manifest.name_col or "key"
        sep = manifest.kv_separator or "__"
        columns = [f.name for f in self.schema.fields if f.name != key_col]
        f, file = self._open(part, whole=True)
        with f:
            rows: dict[str, dict[str, object]] = {}
            for t in f.header.tensors:
                split = split_kv_name(t.name, manifest.schema, sep)
                if split is None:
                    raise ReadError(
                        f"file {file!r}: tensor {t.name!r} is not '<key>{sep}<column>' for a column of the dataset"
                    )
                key, col = split
                if self.wanted_keys is None or key in self.wanted_keys:
                    rows.setdefault(key, {})[col] = t
            keys = sorted(rows)
            out = {key_col: pa.array(keys, pa.string())}
            for col in columns:
                infos = [rows[k].get(col) for k in keys]
                if any(i is None for i in infos):
                    k = keys[infos.index(None)]
                    raise ReadError(f"file {file!r}: key {k!r} has no tensor for column {col!r}")
                if self.options.tensor_format == "struct":
                    out[col] = pa.array(
                        [_tensor_struct(f.raw(i), i) for i in infos], type=TENSOR_STRUCT_ARROW
                    )
                else:
                    arrays = [_convert(f.tensor(i.name), i.dtype.name, file, col) for i in infos]
                    out[col] = _ragged_lists(arrays, len(manifest.schema[col].sample_shape))
            names = [f.name for f in self.schema.fields]
            yield pa.record_batch([out[n] for n in names], names=names)


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
            elif self.view == "kv" and column == key_col:
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


def _ragged_lists(arrays: list[np.ndarray], rank: int) -> pa.Array:
    """One nested list per row, rows of different shapes (KV mode)."""
    if rank == 0:
        return pa.array(np.array([a.reshape(()) for a in arrays]) if arrays else np.empty(0))
    flat = np.concatenate([a.reshape(-1) for a in arrays]) if arrays else np.empty(0, np.float32)
    arr = pa.array(flat)
    shapes = [a.shape for a in arrays]
    for depth in range(rank - 1, -1, -1):
        # lists at this depth: per row, prod(shape[:depth]) lists of length shape[depth]
        lengths = (
            np.concatenate(
                [np.full(math.prod(s[:depth]), s[depth], dtype=np.int64) for s in shapes]
            )
            if shapes
            else np.empty(0, np.int64)
        )
        offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
        np.cumsum(lengths, out=offsets[1:])
        arr = pa.ListArray.from_arrays(pa.array(offsets), arr)
    return arr


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
        cols["data"] = pa.array(data, type=TENSOR_STRUCT_ARROW)
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
