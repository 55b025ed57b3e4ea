"""Shard readers over a ``DatasetLocation``: a local shard memory-mapped (copy-on-write),
a remote one read with ranged reads of just the bytes asked for, and the validated header
of any shard in two small reads."""

from __future__ import annotations

import contextlib
import errno
import mmap

import numpy as np

from ..format import SafetensorsFile
from ..format.errors import InvalidArgumentError
from ..format.header import Header, decode_header, read_header_length
from ..format.shard import open_regular
from .errors import DatasetReplacedError
from .location import DatasetLocation

READ_COALESCING_BYTES = 1 << 20
"""Rows requested together share one ranged read unless more than this many bytes of
unwanted rows lie between them (a request costs about as much as reading ~1 MB)."""


def open_shard(location: DatasetLocation, name: str, *, whole: bool = False) -> ShardReader:
    """A shard opened for reading: memory-mapped (copy-on-write) when local, ranged reads
    otherwise (``whole``: one read of the whole file, for readers that touch every
    tensor). Non-regular files are refused before opening."""
    with location.reading(name):
        size = location.regular_size(name)
        if size is None:
            raise FileNotFoundError(errno.ENOENT, "no such shard", location.display(name))
        if location.is_local:
            return LocalShard(location.path(name))
        return RemoteShard(location, name, size, location.read_bytes(name) if whole else None)


def open_shard_bytes(location: DatasetLocation, name: str) -> ShardBytes:
    """A shard's bytes with its header left unparsed, for readers that take its tensors'
    places from the tensor index: mapped read-only when local, one whole read otherwise."""
    with location.reading(name):
        size = location.regular_size(name)
        if size is None:
            raise FileNotFoundError(errno.ENOENT, "no such shard", location.display(name))
        if location.is_local:
            return ShardBytes(location.display(name), size, path=location.path(name))
        data = location.read_bytes(name)
        if len(data) != size:
            raise DatasetReplacedError(f"{location.display(name)!r} changed while it was read")
        return ShardBytes(location.display(name), size, data=data)


class ShardBytes:
    """The bytes of one shard: ``data_start`` (from its checked 8-byte header length) and
    views of ``[begin, end)`` (absolute offsets, as in the tensor index)."""

    def __init__(self, display: str, size: int, *, path: str | None = None, data=None):
        self.path, self.size, self._file, self._mmap = display, size, None, None
        if path is not None:
            self._file = open_regular(path)  # lives as long as the object
            try:
                self._mmap = (
                    mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
                )
            except BaseException:
                self._file.close()
                raise
            data = self._mmap
        self._data = memoryview(data)
        if len(self._data) != size:
            self.close()
            raise DatasetReplacedError(f"{display!r} changed while it was read")
        self.data_start = 8 + read_header_length(bytes(self._data[:8]), size, display)

    def byte_range(self, begin: int, end: int) -> memoryview:
        if not 0 <= begin <= end <= self.size:
            raise InvalidArgumentError(
                f"file {self.path!r}: byte range [{begin}, {end}) outside its {self.size} bytes"
            )
        return self._data[begin:end]

    def close(self) -> None:
        if isinstance(self._mmap, mmap.mmap):
            with contextlib.suppress(BufferError):  # views still alive; the mapping goes with them
                self._data.release()
                self._mmap.close()
        if self._file is not None:
            self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def read_header(location: DatasetLocation, name: str, size: int | None = None) -> Header:
    """A shard's validated header (two small reads, no tensor bytes)."""
    if size is None:
        size = location.regular_size(name)
        if size is None:
            raise FileNotFoundError(errno.ENOENT, "no such shard", location.display(name))
    prefix = bytes(location.read_range(name, 0, min(8, size)))
    n = read_header_length(prefix, size, location.display(name))
    return decode_header(
        prefix + bytes(location.read_range(name, 8, 8 + n)), size, location.display(name)
    )


class LocalShard:
    """A local shard: the validated header and copy-on-write mmap views of its tensors."""

    def __init__(self, path: str):
        self.path = path
        self._file = SafetensorsFile(path, copy_on_write=True)
        self.header: Header = self._file.header

    def tensor(self, name: str) -> np.ndarray:
        """The whole tensor: a view of the mapping (writable; writes stay in memory)."""
        return self._file.tensor(name)

    def rows(self, name: str, rows: np.ndarray) -> np.ndarray:
        """Rows of a tensor (a copy)."""
        return self._file.tensor(name)[rows]

    def row_range(self, name: str, start: int, stop: int) -> np.ndarray:
        return self._file.tensor(name)[start:stop]

    @property
    def data_start(self) -> int:
        """Where the byte buffer starts (tensor offsets count from here)."""
        return self.header.data_start

    def byte_range(self, begin: int, end: int) -> memoryview:
        return self._file.byte_range(begin, end)

    def raw(self, info) -> memoryview:
        return self._file.raw(info)

    def close(self) -> None:
        self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class RemoteShard:
    """A shard on an object store: the header from two ranged reads, tensors and rows
    fetched with ranged reads of just their bytes (writable copies)."""

    def __init__(self, location: DatasetLocation, name: str, size: int, data: bytes | None = None):
        self.location, self.name, self.size = location, name, size
        self.path = location.display(name)
        self._data = None if data is None else memoryview(data)
        if data is not None and len(data) != size:
            raise DatasetReplacedError(f"{self.path!r} changed while it was read")
        if data is None:
            self.header: Header = read_header(location, name, size)
        else:
            n = read_header_length(bytes(data[:8]), size, self.path)
            self.header = decode_header(bytes(data[: 8 + n]), size, self.path)

    @property
    def data_start(self) -> int:
        """Where the byte buffer starts (tensor offsets count from here)."""
        return self.header.data_start

    def byte_range(self, begin: int, end: int):
        if not 0 <= begin <= end <= self.size:
            raise InvalidArgumentError(
                f"file {self.path!r}: byte range [{begin}, {end}) outside its {self.size} bytes"
            )
        if self._data is not None:
            return self._data[begin:end]
        return self.location.read_range(self.name, begin, end)

    def raw(self, info) -> memoryview:
        start = self.header.data_start + info.begin
        return memoryview(self.byte_range(start, start + info.nbytes))

    def tensor(self, name: str) -> np.ndarray:
        info = self.header[name]
        data = self.raw(info)
        if info.dtype.numpy is None:
            return np.frombuffer(data, dtype=np.uint8).copy()
        return np.frombuffer(data, dtype=info.dtype.numpy).reshape(info.shape).copy()

    def row_range(self, name: str, start: int, stop: int) -> np.ndarray:
        info = self.header[name]
        n = info.shape[0] if info.shape else 1
        start, stop = max(0, start), min(stop, n)
        row_bytes = info.nbytes // max(n, 1)
        base = self.header.data_start + info.begin
        data = self.byte_range(base + start * row_bytes, base + max(stop, start) * row_bytes)
        return (
            np.frombuffer(data, dtype=info.dtype.numpy)
            .reshape(max(stop - start, 0), *info.shape[1:])
            .copy()
        )

    def rows(self, name: str, rows: np.ndarray) -> np.ndarray:
        """Rows of a tensor: rows close together come from one ranged read, so a shuffled
        batch costs a few reads per shard."""
        info = self.header[name]
        sample = info.shape[1:]
        out = np.empty((len(rows), *sample), dtype=info.dtype.numpy)
        if not len(rows):
            return out
        row_bytes = info.nbytes // max(info.shape[0], 1)
        order = np.argsort(rows, kind="stable")
        ordered = rows[order]
        gap = max(1, READ_COALESCING_BYTES // max(row_bytes, 1))
        cuts = np.flatnonzero(np.diff(ordered) > gap) + 1
        for run in np.split(np.arange(len(ordered)), cuts):
            lo, hi = int(ordered[run[0]]), int(ordered[run[-1]]) + 1
            block = self.row_range(name, lo, hi)
            out[order[run]] = block[ordered[run] - lo]
        return out

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


ShardReader = LocalShard | RemoteShard
