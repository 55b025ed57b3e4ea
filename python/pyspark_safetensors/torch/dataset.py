"""Open a safetensors dataset for torch: map-style access by sample index or by key.

Every byte comes through the dataset's ``DatasetLocation``: local tensors are torch views
of a private (copy-on-write) mmap of the shard (no copy, and nothing written to them ever
reaches the file); datasets on object stores (``s3://``, ``gs://``, ``hdfs://``, any fsspec
protocol) are read with ranged reads of just the bytes asked for.
"""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass

import numpy as np
import torch

from ..dataset import (
    DatasetLocation,
    Manifest,
    ManifestError,
    ShardReader,
    load_manifest,
    open_shard,
    read_index,
    split_kv_name,
    verify_dataset,
)
from ..format.errors import InvalidTypeError
from .dtypes import TORCH_DTYPES, as_torch


class _OpenShards:
    """Per-process cache of opened shards (a forked DataLoader worker opens its own)."""

    def __init__(self, location: DatasetLocation):
        self.location = location
        self.pid = os.getpid()
        self.shards: dict[str, ShardReader] = {}

    def get(self, name: str) -> ShardReader:
        if self.pid != os.getpid():
            self.pid, self.shards = os.getpid(), {}
        f = self.shards.get(name)
        if f is None:
            f = self.shards[name] = open_shard(self.location, name)
        return f

    def __getstate__(self):
        return {"location": self.location}

    def __setstate__(self, state):
        self.__init__(state["location"])


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

    def __init__(self, location: DatasetLocation, manifest: Manifest):
        self.location = location
        self.manifest = manifest
        self.paths = [s.shard_path for s in manifest.shards]
        """Shard names inside the location, in manifest order."""
        self.counts = [s.samples_count for s in manifest.shards]
        # global index of each shard's first sample
        self.starts = np.cumsum([0, *self.counts])[:-1].tolist()
        self._shards = _OpenShards(location)
        self._keys: dict[str, dict[str, KeyLocation]] | None = None
        self.checksums = False
        """Whether the tensor index is checked against its crc32c when loaded."""

    @property
    def root(self) -> DatasetLocation:
        return self.location

    def grown(self, manifest: Manifest) -> SafetensorsDataset:
        """This dataset at a later commit ``manifest`` (an append: its shards are these
        and more), keeping the shards already opened."""
        ds = SafetensorsDataset(self.location, manifest)
        ds._shards, ds.checksums = self._shards, self.checksums
        return ds

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

    def shard(self, shard: int) -> ShardReader:
        """An opened shard, its header checked against the manifest entry once."""
        return self._shards.get(self.paths[shard])

    def shard_view(self, shard: int, column: str) -> np.ndarray:
        """The whole ``column`` tensor of a shard: a copy-on-write mmap view locally, an
        array read with one ranged read elsewhere."""
        return self.shard(shard).tensor(column)

    def read_rows(self, shard: int, column: str, rows: np.ndarray) -> np.ndarray:
        """``shard_view(shard, column)[rows]`` (a copy). Remote: rows close together are
        fetched with one ranged read, so a shuffled batch costs a few reads per shard."""
        return self.shard(shard).rows(column, rows)

    def __getitem__(self, index):
        if isinstance(index, str):
            return self.get(index)
        if self.mode != "batch":
            raise InvalidTypeError(
                "a KV dataset is indexed by key: ds['key'] or ds.get(key, column)"
            )
        shard, row = self.locate(int(index))
        out = {}
        f = self.shard(shard)
        for c, col in self.manifest.schema.items():
            one = f.row_range(c, row, row + 1)  # a view when mapped, also for scalars
            out[c] = as_torch(one.reshape(one.shape[1:]), col.dtype)
        return out

    # -- KV mode

    def _key_index(self) -> dict[str, dict[str, KeyLocation]]:
        if self._keys is None:
            if self.mode != "kv":
                raise InvalidTypeError("key lookups need a KV dataset (written with name_col)")
            table = read_index(self.location, self.manifest, checksums=self.checksums).to_pydict()
            sep = self.manifest.kv_separator or "__"
            columns = list(self.manifest.schema)
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
                split = split_kv_name(name, columns, sep)
                if split is None:
                    raise ManifestError(
                        f"dataset {self.location.uri!r}: index key {name!r} is not '<key>{sep}<column>' for a column of the dataset"
                    )
                key, column = split
                keys.setdefault(key, {})[column] = KeyLocation(
                    file, begin, end, dtype, tuple(shape)
                )
            self._keys = keys
        return self._keys

    def keys(self) -> list[str]:
        return list(self._key_index())

    def get(self, key: str, column: str | None = None):
        """``{column: tensor}`` for ``key``, or one tensor when ``column`` is given."""
        entry = self._key_index().get(key)
        if entry is None:
            raise KeyError(f"no key {key!r} in dataset {self.location.uri!r}")
        if column is not None:
            if column not in entry:
                raise KeyError(f"key {key!r} has no column {column!r}; it has {sorted(entry)}")
            return self._read(entry[column])
        return {c: self._read(loc) for c, loc in entry.items()}

    def _read(self, loc: KeyLocation) -> torch.Tensor:
        raw = np.frombuffer(self._shards.get(loc.file).byte_range(loc.begin, loc.end), np.uint8)
        if not raw.flags.writeable:
            raw = raw.copy()
        d = TORCH_DTYPES[loc.dtype]
        return (
            as_torch(raw, "U8").view(d).reshape(loc.shape)
            if raw.size
            else torch.empty(loc.shape, dtype=d)
        )


def open_dataset(
    path: str | os.PathLike | DatasetLocation,
    *,
    checksums: bool = False,
    filesystem=None,
    storage_options: dict | None = None,
) -> SafetensorsDataset:
    """Open a dataset directory: the manifest is loaded and checked against the files
    (present, regular files inside the directory, sizes, headers agreeing with the schema
    and row counts; crc32c of every shard and of the tensor index with ``checksums=True``).
    Errors name the file.

    ``path``: a local directory (or ``file:`` URI), memory-mapped; or a URI
    (``s3://bucket/acts``, ``s3a://``, ``gs://``, ``abfss://``, ``hdfs://``, ``memory://`` or
    any fsspec protocol) read with one listing and ranged reads; or a path on
    ``filesystem`` (a ``pyarrow.fs`` or fsspec filesystem). ``storage_options`` as in
    ``DatasetLocation.of`` (e.g. ``{"endpoint_url": "http://127.0.0.1:9000"}``).
    """
    location = DatasetLocation.of(path, filesystem, storage_options)
    manifest = load_manifest(location)
    manifest.refuse_partitioned(location.uri, "open_dataset")
    ds = SafetensorsDataset(
        location, verify_dataset(location, checksums=checksums, manifest=manifest)
    )
    ds.checksums = checksums
    return ds
