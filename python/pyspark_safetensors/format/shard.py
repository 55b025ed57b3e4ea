"""Write one safetensors file by streaming, and read tensors back as zero-copy views.

``write_shard`` writes the header and then each tensor's bytes straight from its numpy
buffer (no copy of the whole file in memory) to a temporary name in the target
directory, fsyncs, and renames into place: a reader sees the whole file or nothing.
``write_packed`` does the same for many small tensors packed into a few buffers.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import math
import mmap
import os
import stat
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .dtypes import DType, dtype_of
from .errors import (
    InvalidArgumentError,
    InvalidTypeError,
    NotRegularFileError,
    ShapeError,
    TruncatedFileError,
)
from .header import (
    Header,
    HeaderLayout,
    Spec,
    TensorInfo,
    decode_header,
    encode_header,
    layout_header,
    read_header_length,
)

_WRITE_CHUNK = 64 << 20  # bytes per write call; bounds the kernel-side copy


def _little_endian_bytes(array: np.ndarray) -> memoryview:
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    flat = np.ascontiguousarray(array).reshape(-1)
    return memoryview(flat.view(np.uint8))


@dataclass(frozen=True)
class ChunkedTensor:
    """A tensor whose bytes are the concatenation of several arrays (e.g. the Arrow
    batches of one shard), written one after the other without joining them in memory."""

    dtype: DType
    shape: tuple[int, ...]
    parts: tuple[np.ndarray, ...]

    def __post_init__(self):
        for p in self.parts:
            if dtype_of(p) != self.dtype:
                raise InvalidTypeError(f"chunk of dtype {p.dtype} in a {self.dtype} tensor")
        if sum(p.size for p in self.parts) != math.prod(self.shape):
            raise InvalidArgumentError(
                f"chunks hold {sum(p.size for p in self.parts)} elements, shape {list(self.shape)} needs {math.prod(self.shape)}"
            )


Tensor = np.ndarray | ChunkedTensor


def _spec(t: Tensor) -> tuple[DType, tuple[int, ...]]:
    if isinstance(t, ChunkedTensor):
        return t.dtype, t.shape
    return dtype_of(t), tuple(t.shape)


def _parts(t: Tensor) -> tuple[np.ndarray, ...]:
    return t.parts if isinstance(t, ChunkedTensor) else (t,)


def write_shard(
    path: str | os.PathLike,
    tensors: Mapping[str, Tensor],
    metadata: Mapping[str, str] | None = None,
    *,
    fsync: bool = True,
    on_bytes: Callable[[memoryview], None] | None = None,
) -> Header:
    """Write ``tensors`` (numpy arrays whose dtypes map to safetensors dtypes, bfloat16 and
    float8 via ``ml_dtypes``, or ``ChunkedTensor``s) to ``path`` atomically.

    ``on_bytes`` sees every byte written, in order (e.g. to checksum the file).
    Returns the header written."""
    header_bytes, infos = encode_header({n: _spec(t) for n, t in tensors.items()}, metadata)
    _write_atomically(path, _file_pieces(header_bytes, infos, tensors), fsync, on_bytes)
    return Header(tuple(infos), dict(metadata) if metadata is not None else None, len(header_bytes))


def _file_pieces(header_bytes, infos, tensors):
    """The file's bytes in order, straight from each tensor's buffers."""
    yield memoryview(header_bytes)
    for info in infos:
        for part in _parts(tensors[info.name]):
            data = _little_endian_bytes(part)
            for start in range(0, len(data), _WRITE_CHUNK):
                yield data[start : start + _WRITE_CHUNK]


@dataclass(frozen=True)
class PackedTensors:
    """Many small tensors stored back to back in one byte buffer (e.g. one tensor per
    Spark row): tensor ``i`` has dtype and shape ``specs[spec_of[i]]`` and its
    little-endian bytes start at ``data[starts[i]]``."""

    data: np.ndarray
    """1-D uint8."""
    starts: np.ndarray
    """int64 byte offsets, one per tensor."""
    specs: tuple[Spec, ...]
    spec_of: np.ndarray
    """int64 indices into ``specs``, one per tensor."""

    def __len__(self) -> int:
        return len(self.starts)

    @property
    def sizes(self) -> np.ndarray:
        """Bytes of each tensor."""
        spec_bytes = [dtype.nbytes(math.prod(shape)) for dtype, shape in self.specs]
        return np.array(spec_bytes or [0], dtype=np.int64)[self.spec_of]

    def take(self, rows: slice | np.ndarray) -> PackedTensors:
        """Some of the tensors (same buffer, no copy of their bytes)."""
        return PackedTensors(self.data, self.starts[rows], self.specs, self.spec_of[rows])

    @classmethod
    def of(cls, arrays: list[np.ndarray]) -> PackedTensors:
        """Pack separate arrays (one copy of their bytes)."""
        ids: dict[Spec, int] = {}
        spec_of = np.array(
            [ids.setdefault((dtype_of(a), a.shape), len(ids)) for a in arrays], dtype=np.int64
        )
        sizes = np.array([a.nbytes for a in arrays], dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        data = (
            np.concatenate([_little_endian_bytes(a) for a in arrays])
            if arrays
            else np.empty(0, np.uint8)
        )
        return cls(data, starts[: len(arrays)], tuple(ids), spec_of)


def write_packed(
    path: str | os.PathLike,
    groups: Sequence[tuple[Sequence[str], PackedTensors]],
    metadata: Mapping[str, str] | None = None,
    *,
    fsync: bool = True,
    on_bytes: Callable[[memoryview], None] | None = None,
) -> HeaderLayout:
    """Write the tensors of several ``(names, PackedTensors)`` groups to ``path``
    atomically, as ``write_shard`` would write them one by one but without a Python
    object per tensor: the header is laid out in bulk and the bytes are gathered into
    file order a few MB at a time."""
    ids: dict[Spec, int] = {}
    names: list[str] = []
    spec_of, buffer_of, starts = [], [], []
    for i, (group_names, packed) in enumerate(groups):
        if len(group_names) != len(packed):
            raise InvalidArgumentError(
                f"group {i}: {len(group_names)} names for {len(packed)} tensors"
            )
        remap = np.array([ids.setdefault(s, len(ids)) for s in packed.specs] or [0], np.int64)
        names.extend(group_names)
        spec_of.append(remap[packed.spec_of])
        buffer_of.append(np.full(len(packed), i, dtype=np.int64))
        starts.append(packed.starts)
    layout = layout_header(names, list(ids), _concat(spec_of), metadata)
    buffers = [packed.data for _, packed in groups]
    pieces = _gather(
        layout, buffers, _concat(buffer_of)[layout.order], _concat(starts)[layout.order]
    )
    _write_atomically(path, itertools.chain([memoryview(layout.header)], pieces), fsync, on_bytes)
    return layout


def _concat(arrays: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(arrays) if arrays else np.empty(0, np.int64)


def _gather(layout: HeaderLayout, buffers, buffer_of: np.ndarray, starts: np.ndarray):
    """Tensor bytes in file order (``buffer_of``/``starts`` already are), one buffer of
    about ``_WRITE_CHUNK / 8`` bytes at a time."""
    sizes = layout.ends - layout.begins
    if not len(sizes):
        return
    size = int(sizes[0])
    if size and (sizes == size).all() and not (starts % size).any():
        # Equal-sized tensors on row boundaries (the usual KV shard): each buffer is a
        # matrix of rows, and numpy gathers whole rows per chunk.
        matrices = [b[: len(b) // size * size].reshape(-1, size) for b in buffers]
        rows = starts // size
        step = max(1, (_WRITE_CHUNK // 8) // size)
        for lo in range(0, len(rows), step):
            chunk_rows, chunk_src = rows[lo : lo + step], buffer_of[lo : lo + step]
            out = np.empty((len(chunk_rows), size), dtype=np.uint8)
            if chunk_src[0] == chunk_src[-1] and (chunk_src == chunk_src[0]).all():
                np.take(matrices[chunk_src[0]], chunk_rows, axis=0, out=out)
            else:
                for b in np.unique(chunk_src).tolist():
                    mine = chunk_src == b
                    out[mine] = matrices[b][chunk_rows[mine]]
            yield memoryview(out.reshape(-1))
        return
    # Mixed sizes: join each chunk's slices (one copy, one slice object per tensor).
    views = [memoryview(b) for b in buffers]
    ends = (starts + sizes).tolist()
    cum = np.cumsum(sizes)
    cuts = [0, *(np.flatnonzero(np.diff(cum // (_WRITE_CHUNK // 8))) + 1).tolist(), len(sizes)]
    sources, begins = buffer_of.tolist(), starts.tolist()
    for lo, hi in itertools.pairwise(cuts):
        yield memoryview(b"".join([views[sources[i]][begins[i] : ends[i]] for i in range(lo, hi)]))


def _write_atomically(
    path: str | os.PathLike, pieces, fsync: bool, on_bytes: Callable[[memoryview], None] | None
) -> None:
    """Write ``pieces`` to a temporary name beside ``path``, fsync, rename into place."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb", buffering=0) as f:
            for data in pieces:
                f.write(data)
                if on_bytes is not None:
                    on_bytes(data)
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def open_regular(path: str) -> io.BufferedReader:
    """Open a file for reading, refusing anything but a regular file before any read
    (opened non-blocking, so a FIFO cannot hang the open; a directory gets our error,
    not ``IsADirectoryError``)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
            raise NotRegularFileError(f"the path is {kind}", path=path)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_header(path: str | os.PathLike) -> Header:
    """Read and validate only the header of a file (two small reads, no tensor bytes)."""
    path = os.fspath(path)
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        prefix = f.read(8)
        n = read_header_length(prefix, size, path)
        body = f.read(n)
    return decode_header(prefix + body, size, path)


class SafetensorsFile:
    """A safetensors file opened for reading: the validated header plus zero-copy numpy
    views of its tensors over a read-only mmap.

        with SafetensorsFile("model.safetensors") as f:
            w = f.tensor("weight")       # a view of the mapped file, no copy
    """

    def __init__(self, path: str | os.PathLike, *, copy_on_write: bool = False):
        """``copy_on_write`` maps the file privately: views are writable (as torch wants)
        and writes stay in memory, never reaching the file."""
        self.path = os.fspath(path)
        self._file = open_regular(self.path)  # lives as long as the object
        try:
            size = os.fstat(self._file.fileno()).st_size
            if size < 8:
                raise TruncatedFileError(
                    f"file is {size} bytes, shorter than the 8-byte header length", path=self.path
                )
            access = mmap.ACCESS_COPY if copy_on_write else mmap.ACCESS_READ
            self._mmap = mmap.mmap(self._file.fileno(), 0, access=access)
            n = read_header_length(self._mmap[:8], size, self.path)
            self.header = decode_header(self._mmap[: 8 + n], size, self.path)
        except BaseException:
            self.close()
            raise

    @property
    def metadata(self) -> dict[str, str] | None:
        return self.header.metadata

    def keys(self) -> list[str]:
        return self.header.names()

    def __iter__(self):
        return iter(self.header.names())

    def byte_range(self, begin: int, end: int) -> memoryview:
        """Bytes ``[begin, end)`` of the file (absolute offsets, as in the tensor index)
        as a view of the mapping."""
        if not 0 <= begin <= end <= len(self._mmap):
            raise InvalidArgumentError(
                f"file {self.path!r}: byte range [{begin}, {end}) outside its {len(self._mmap)} bytes"
            )
        return memoryview(self._mmap)[begin:end]

    def raw(self, info: TensorInfo) -> memoryview:
        """The tensor's bytes as a view of the mapped file."""
        start = self.header.data_start + info.begin
        return self.byte_range(start, start + info.nbytes)

    def tensor(self, name: str) -> np.ndarray:
        """A read-only numpy view of one tensor (raw uint8 bytes for sub-byte dtypes)."""
        info = self.header[name]
        if info.dtype.numpy is None:
            return np.frombuffer(self.raw(info), dtype=np.uint8)
        flat = np.frombuffer(self.raw(info), dtype=info.dtype.numpy)
        try:
            return flat.reshape(info.shape)
        except ValueError:  # valid for the format (an empty tensor), too large for numpy
            raise ShapeError(
                f"shape {list(info.shape)} has no numpy form (numpy sizes are signed 64-bit)",
                path=self.path,
                tensor=name,
            ) from None

    def close(self) -> None:
        mm = getattr(self, "_mmap", None)
        if mm is not None:
            with contextlib.suppress(BufferError):  # views still alive; the mapping goes with them
                mm.close()
        self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
