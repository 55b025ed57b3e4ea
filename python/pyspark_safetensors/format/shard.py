"""Write one safetensors file by streaming, and read tensors back as zero-copy views.

``write_shard`` writes the header and then each tensor's bytes straight from its numpy
buffer (no copy of the whole file in memory) to a temporary name in the target
directory, fsyncs, and renames into place: a reader sees the whole file or nothing.
"""

from __future__ import annotations

import mmap
import os
import uuid
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from .dtypes import DType, dtype_of
from .errors import TruncatedFileError
from .header import Header, TensorInfo, decode_header, encode_header, read_header_length

_WRITE_CHUNK = 64 << 20  # bytes per write call; bounds the kernel-side copy


def _little_endian_bytes(array: np.ndarray) -> memoryview:
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    flat = np.ascontiguousarray(array).reshape(-1)
    return memoryview(flat.view(np.uint8))


def shard_tensors(tensors: Mapping[str, np.ndarray]) -> dict[str, tuple[DType, tuple[int, ...]]]:
    """``{name: (dtype, shape)}`` for numpy arrays, their dtype read from the array."""
    return {name: (dtype_of(a), tuple(a.shape)) for name, a in tensors.items()}


def write_shard(
    path: str | os.PathLike,
    tensors: Mapping[str, np.ndarray],
    metadata: Mapping[str, str] | None = None,
    *,
    fsync: bool = True,
) -> Header:
    """Write ``tensors`` (numpy arrays whose dtypes map to safetensors dtypes; bfloat16 and
    float8 via ``ml_dtypes``) to ``path`` atomically. Returns the header written."""
    path = Path(path)
    header_bytes, infos = encode_header(shard_tensors(tensors), metadata)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb", buffering=0) as f:
            f.write(header_bytes)
            for info in infos:
                data = _little_endian_bytes(tensors[info.name])
                for start in range(0, len(data), _WRITE_CHUNK):
                    f.write(data[start : start + _WRITE_CHUNK])
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return Header(tuple(infos), dict(metadata) if metadata is not None else None, len(header_bytes))


def read_header(path: str | os.PathLike) -> Header:
    """Read and validate only the header of a file (two small reads, no tensor bytes)."""
    path = os.fspath(path)
    with open(path, "rb") as f:
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

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._file = open(self.path, "rb")
        try:
            size = os.fstat(self._file.fileno()).st_size
            if size < 8:
                raise TruncatedFileError(f"file is {size} bytes, shorter than the 8-byte header length", path=self.path)
            self._mmap = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
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

    def raw(self, info: TensorInfo) -> memoryview:
        """The tensor's bytes as a view of the mapped file."""
        start = self.header.data_start + info.begin
        return memoryview(self._mmap)[start : start + info.nbytes]

    def tensor(self, name: str) -> np.ndarray:
        """A read-only numpy view of one tensor (raw uint8 bytes for sub-byte dtypes)."""
        info = self.header[name]
        if info.dtype.numpy is None:
            return np.frombuffer(self.raw(info), dtype=np.uint8)
        return np.frombuffer(self.raw(info), dtype=info.dtype.numpy).reshape(info.shape)

    def close(self) -> None:
        mm = getattr(self, "_mmap", None)
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # views still alive; the mapping goes when they do
                pass
        self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
