"""Open a safetensors dataset for torch: map-style access by sample index or by key.

Local tensors come back as torch views of a private (copy-on-write) mmap of the shard: no
copy, and nothing written to them ever reaches the file. Remote datasets (``s3://``,
``gs://``, ``hdfs://``, any fsspec protocol) are read with ranged reads of just the bytes
asked for.
"""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..dataset import Manifest, read_index, verify_dataset
from ..dataset.remote import RemoteDir, open_location
from ..format import SafetensorsFile
from ..format.header import Header

_TORCH_DTYPES = {
    "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "U16": torch.uint16,
    "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64, "U64": torch.uint64,
}  # fmt: skip


def as_torch(array: np.ndarray, dtype: str) -> torch.Tensor:
    """A torch view of a numpy array holding ``dtype``'s bytes (bfloat16 included)."""
    target = _TORCH_DTYPES[dtype]
    if array.dtype.kind in "fiub" and array.dtype.itemsize == target.itemsize and dtype != "BF16":
        return torch.from_numpy(array)
    raw = torch.from_numpy(
        array.view(
            np.uint8
            if target.itemsize == 1
            else np.int16
            if target.itemsize == 2
            else np.int32
            if target.itemsize == 4
            else np.int64
        )
    )
    return raw.view(target)


class _OpenFiles:
    """Per-process cache of mapped shards (a forked DataLoader worker maps its own)."""

    def __init__(self):
        self.pid = os.getpid()
        self.files: dict[str, SafetensorsFile] = {}

    def get(self, path: str) -> SafetensorsFile:
        if self.pid != os.getpid():
            self.pid, self.files = os.getpid(), {}
        f = self.files.get(path)
        if f is None:
            f = self.files[path] = SafetensorsFile(path, copy_on_write=True)
        return f

    def __getstate__(self):
        return {}

    def __setstate__(self, state):
        self.__init__()


@dataclass(frozen=True)
class KeyLocation:
    file: str
    begin: int
    end: int
    dtype: str
    shape: tuple[int, ...]


class SafetensorsDataset(torch.utils.data.Dataset):
    """A dataset written by the Spark writer (or any writer of the same layout).

    Batch mode: ``ds[i]`` is ``{column: tensor}`` for global sample ``i``; ``len(ds)`` is
    the manifest's ``total_samples``. KV mode: ``ds[key]`` / ``ds.get(key)`` is
    ``{column: tensor}`` and ``ds.get(key, column)`` one tensor, found through the tensor
    index (one lookup, one ranged read, no header parse).
    """

    def __init__(self, root: Path | RemoteDir, manifest: Manifest):
        self.root = root
        self.manifest = manifest
        self.remote = isinstance(root, RemoteDir)
        # local: absolute paths (mapped); remote: names inside the directory (ranged reads)
        self.paths = (
            [s.shard_path for s in manifest.shards]
            if self.remote
            else [str(p) for p in manifest.shard_paths(root)]
        )
        self._headers: dict[int, Header] = {}
        self.counts = [s.samples_count for s in manifest.shards]
        self.starts = np.cumsum([0, *self.counts])[
            :-1
        ].tolist()  # global index of each shard's first sample
        self._files = _OpenFiles()
        self._keys: dict[str, dict[str, KeyLocation]] | None = None

    # -- facts

    @property
    def mode(self) -> str:
        return self.manifest.mode

    @property
    def columns(self) -> list[str]:
        return list(self.manifest.schema)

    @property
    def metadata(self) -> dict[str, str]:
        return self.manifest.metadata

    def __len__(self) -> int:
        return self.manifest.total_samples

    # -- batch mode

    def locate(self, index: int) -> tuple[int, int]:
        """(shard number, row in shard) of a global sample index."""
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range for a dataset of {len(self)}")
        shard = bisect.bisect_right(self.starts, index) - 1
        return shard, index - self.starts[shard]

    def shard_view(self, shard: int, column: str) -> np.ndarray:
        """The whole ``column`` tensor of a shard: a (copy-on-write) mmap view, or for a
        remote dataset an array read with one ranged read."""
        if not self.remote:
            return self._files.get(self.paths[shard]).tensor(column)
        header = self._header(shard)
        info = header[column]
        start = header.data_start + info.begin
        return self._remote_array(shard, start, start + info.nbytes, info.dtype.numpy, info.shape)

    def read_rows(self, shard: int, column: str, rows: np.ndarray) -> np.ndarray:
        """``shard_view(shard, column)[rows]`` (a copy). Remote: rows close together are
        fetched with one ranged read, so a shuffled batch costs a few reads per shard."""
        if not self.remote:
            return self.shard_view(shard, column)[rows]
        header = self._header(shard)
        info = header[column]
        row_bytes = info.nbytes // max(info.shape[0], 1)
        sample = info.shape[1:]
        out = np.empty((len(rows), *sample), dtype=info.dtype.numpy)
        order = np.argsort(rows, kind="stable")
        ordered = rows[order]
        # a new read where the gap to the next wanted row exceeds ~1 MB of unwanted rows
        gap = max(1, (1 << 20) // max(row_bytes, 1))
        cuts = np.flatnonzero(np.diff(ordered) > gap) + 1
        for run in np.split(np.arange(len(ordered)), cuts):
            lo, hi = int(ordered[run[0]]), int(ordered[run[-1]]) + 1
            start = header.data_start + info.begin + lo * row_bytes
            block = self._remote_array(
                shard, start, start + (hi - lo) * row_bytes, info.dtype.numpy, (hi - lo, *sample)
            )
            out[order[run]] = block[ordered[run] - lo]
        return out

    def _header(self, shard: int) -> Header:
        header = self._headers.get(shard)
        if header is None:
            entry = self.manifest.shards[shard]
            header = self._headers[shard] = self.root.read_header(entry.shard_path, entry.bytes)
        return header

    def _remote_array(self, shard: int, begin: int, end: int, dtype, shape) -> np.ndarray:
        buf = self.root.read_range(self.paths[shard], begin, end)
        # a writable copy: torch warns on read-only arrays, and remote bytes are copied anyway
        return np.frombuffer(buf, dtype=dtype).reshape(shape).copy()

    def __getitem__(self, index):
        if isinstance(index, str):
            return self.get(index)
        if self.mode != "batch":
            raise TypeError("a KV dataset is indexed by key: ds['key'] or ds.get(key, column)")
        shard, row = self.locate(int(index))
        out = {}
        for c, col in self.manifest.schema.items():
            if self.remote:
                rows = self.read_rows(shard, c, np.array([row]))
                out[c] = as_torch(rows.reshape(rows.shape[1:]), col.dtype)
                continue
            view = self.shard_view(shard, c)
            out[c] = as_torch(
                view[row : row + 1].reshape(view.shape[1:]), col.dtype
            )  # a view, also for scalars
        return out

    # -- KV mode

    def _key_index(self) -> dict[str, dict[str, KeyLocation]]:
        if self._keys is None:
            if self.mode != "kv":
                raise TypeError("key lookups need a KV dataset (written with name_col)")
            if self.manifest.index_file is None:
                raise ValueError(
                    f"dataset {str(self.root)!r} has no tensor index; write it with generate_index=true"
                )
            table = (self.root.read_index() if self.remote else read_index(self.root)).to_pydict()
            sep = self.manifest.kv_separator or "__"
            keys: dict[str, dict[str, KeyLocation]] = {}
            for name, file, shape, dtype, begin, end in zip(
                table["tensor_key"],
                table["file_name"],
                table["shape"],
                table["dtype"],
                table["begin"],
                table["end"],
                strict=True,
            ):
                key, _, column = name.rpartition(sep)
                keys.setdefault(key, {})[column] = KeyLocation(
                    file if self.remote else str(self.root / file), begin, end, dtype, tuple(shape)
                )
            self._keys = keys
        return self._keys

    def keys(self) -> list[str]:
        return list(self._key_index())

    def get(self, key: str, column: str | None = None):
        """``{column: tensor}`` for ``key``, or one tensor when ``column`` is given."""
        entry = self._key_index().get(key)
        if entry is None:
            raise KeyError(f"no key {key!r} in dataset {str(self.root)!r}")
        if column is not None:
            if column not in entry:
                raise KeyError(f"key {key!r} has no column {column!r}; it has {sorted(entry)}")
            return self._read(entry[column])
        return {c: self._read(loc) for c, loc in entry.items()}

    def _read(self, loc: KeyLocation) -> torch.Tensor:
        if self.remote:
            raw = np.frombuffer(
                self.root.read_range(loc.file, loc.begin, loc.end), dtype=np.uint8
            ).copy()
        else:
            raw = np.frombuffer(
                self._files.get(loc.file).byte_range(loc.begin, loc.end), dtype=np.uint8
            )
        d = _TORCH_DTYPES[loc.dtype]
        return (
            as_torch(raw, "U8").view(d).reshape(loc.shape)
            if raw.size
            else torch.empty(loc.shape, dtype=d)
        )


def open_dataset(
    path: str | os.PathLike, *, checksums: bool = False, filesystem=None
) -> SafetensorsDataset:
    """Open a dataset directory: the manifest is loaded and checked against the files
    (present, inside the directory, sizes, headers agreeing with the schema; crc32c of
    every shard with ``checksums=True``). Errors name the file.

    ``path``: a local directory (or ``file:`` URI), memory-mapped; or a remote URI
    (``s3://bucket/acts``, ``gs://``, ``hdfs://``, ``memory://`` or any fsspec protocol),
    or a path on ``filesystem`` (a ``pyarrow.fs`` or fsspec filesystem), read with one
    listing and ranged reads.
    """
    location = open_location(path, filesystem)
    if isinstance(location, RemoteDir):
        return SafetensorsDataset(location, location.verify(checksums=checksums))
    return SafetensorsDataset(location, verify_dataset(location, checksums=checksums))
