"""Reading Zarr activation stores (the Zarr activation-logger layout) and sharded runs.

A store (``activations.zarr/``, Zarr format 2) holds ``arrays/activations``
``(N, L, T_max, H)`` float16 chunked ``(1, 1, T_chunk, H)`` without compression,
``arrays/seq_len`` ``(N,)`` and optional per-sample arrays, ``text/*.jsonl`` and the global
metadata in the root attributes. A sharded run holds ``shards/shard-XXXX.zarr`` stores and
a ``manifest.json`` mapping each global sample index to ``(shard_path, local_index)``.

``read(i, l)`` returns ``activations[i, l, :seq_len[i], :]`` and touches only the chunks
of that (sample, layer). Two paths do it: zarr-python's (any store zarr can read) and a
direct one that ``pread``s the uncompressed chunk files of a local store into the output
(the default where the array allows it; ``fast=False`` picks zarr's, and a test checks
that both agree).
"""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..convert import ConversionError

ACTIVATIONS = "arrays/activations"
SEQ_LEN = "arrays/seq_len"
SAMPLE_KEY = "arrays/sample_key"
OPTIONAL_ARRAYS = {
    "prompt_len": "i",
    "response_len": "i",
    "hallu_label": "ib",
    "split": "i",
}
"""Optional per-sample arrays of the specification: name -> accepted numpy kinds."""
TEXT_FILES = ("prompts.jsonl", "responses.jsonl", "extra_metadata.jsonl")
RUN_MANIFEST = "manifest.json"
RUN_KEYS = (
    "schema_version", "model_id", "num_layers", "hidden_size", "T_max", "dtype",
    "created_at", "num_shards", "total_samples", "shards", "samples",
)  # fmt: skip
SCHEMA_VERSION = "1.0"
MIN_CHUNK_BYTES = 512 * 1024
MAX_CHUNK_BYTES = 2 * 1024 * 1024


class ZarrStoreError(ConversionError):
    """A store or run that does not follow the layout: names the array, sample or file."""


class PerformanceWarning(UserWarning):
    """A store that reads correctly but breaks the layout's performance contract."""


def token_chunk(t_max: int, hidden_size: int) -> int:
    """``T_chunk`` for a ``(T_max, H)`` float16 layer: the whole sequence when it is under
    0.5 MiB (one read per (sample, layer)), otherwise the largest power of two whose chunk
    stays within 2 MiB (at least 0.5 MiB when ``H`` allows it)."""
    row = hidden_size * 2
    if t_max * row < MIN_CHUNK_BYTES:
        return t_max
    chunk = 1
    while chunk * 2 * row <= MAX_CHUNK_BYTES and chunk * 2 <= t_max:
        chunk *= 2
    return chunk


def is_store(path: Path) -> bool:
    return any((path / name).is_file() for name in (".zgroup", ".zattrs", "zarr.json"))


def is_run(path: Path) -> bool:
    return (path / RUN_MANIFEST).is_file() and (path / "shards").is_dir()


@dataclass(frozen=True)
class _Layout:
    """What the direct chunk-file path needs to know about ``arrays/activations``."""

    dir: str
    separator: str
    t_chunk: int
    fill: float


class ActivationStore:
    """One Zarr activation store, opened read-only.

        store = ActivationStore("acts.zarr")
        x = store.read(3, 1)              # numpy [seq_len[3], H] float16
        t = store.read(3, 1, torch=True)  # the same as a torch tensor

    Safe to hand to DataLoader workers (``fork`` or ``spawn``): zarr handles are opened
    lazily in each process and never pickled. ``fast`` (default: where possible) reads
    uncompressed chunk files directly; ``fast=False`` always goes through zarr-python.
    """

    def __init__(self, path: str | os.PathLike, *, fast: bool = True, warn: bool = True):
        self.path = Path(path)
        self.fast_requested = fast
        group = self._open()
        acts = self._activations(group)
        self.num_samples, self.num_layers, self.t_max, self.hidden_size = acts.shape
        self.chunks = tuple(acts.chunks)
        self.attrs = dict(group.attrs)
        self.seq_len = self._seq_len(group)
        self.arrays = self._optional(group)
        self.sample_keys = self.arrays.pop("sample_key", None)
        self.compressed = _compressed(acts)
        self.layout = self._direct_layout(acts)
        if warn:
            self._warn(acts)
        self._group = group
        self._acts = acts

    # -- opening and checks

    def _open(self):
        import zarr

        if not self.path.is_dir() or not is_store(self.path):
            raise ZarrStoreError(f"{self.path}: not a Zarr store (no .zgroup / .zattrs)")
        try:
            with warnings.catch_warnings():
                # text/ and meta/ are plain folders by design, not Zarr nodes
                warnings.filterwarnings("ignore", "Object at .* is not recognized")
                return zarr.open_group(str(self.path), mode="r")
        except Exception as e:  # zarr raises many kinds for a broken store
            raise ZarrStoreError(f"{self.path}: cannot open the Zarr group ({e})") from e

    def _activations(self, group):
        try:
            acts = group[ACTIVATIONS]
        except KeyError:
            raise ZarrStoreError(
                f"{self.path}: no array {ACTIVATIONS} (N, L, T_max, H) float16"
            ) from None
        if acts.ndim != 4:
            raise ZarrStoreError(
                f"{self.path}/{ACTIVATIONS}: rank {acts.ndim} (shape {list(acts.shape)}); "
                "expected (N, L, T_max, H)"
            )
        if acts.dtype != np.float16:
            raise ZarrStoreError(
                f"{self.path}/{ACTIVATIONS}: dtype {acts.dtype}; expected float16 "
                "(convert with --dtype or cast before writing)"
            )
        return acts

    def _seq_len(self, group) -> np.ndarray:
        try:
            seq = group[SEQ_LEN]
        except KeyError:
            raise ZarrStoreError(
                f"{self.path}: no array {SEQ_LEN} (N,) int32; it is required (tokens per sample)"
            ) from None
        self._check_per_sample(SEQ_LEN, seq, "iu")
        values = np.asarray(seq[:], dtype=np.int64)
        bad = np.flatnonzero((values < 0) | (values > self.t_max))
        if len(bad):
            i = int(bad[0])
            raise ZarrStoreError(
                f"{self.path}/{SEQ_LEN}: sample {i} has seq_len {values[i]} outside "
                f"[0, T_max={self.t_max}] ({len(bad)} sample(s) in all)"
            )
        return values.astype(np.int32)

    def _check_per_sample(self, name: str, array, kinds: str) -> None:
        if array.ndim != 1 or array.shape[0] != self.num_samples:
            raise ZarrStoreError(
                f"{self.path}/{name}: shape {list(array.shape)}; expected ({self.num_samples},)"
            )
        if array.dtype.kind not in kinds:
            raise ZarrStoreError(f"{self.path}/{name}: dtype {array.dtype} is not allowed here")

    def _optional(self, group) -> dict[str, np.ndarray]:
        out = {}
        for name, kinds in {**OPTIONAL_ARRAYS, "sample_key": "S"}.items():
            full = f"arrays/{name}"
            if full in group:
                array = group[full]
                self._check_per_sample(full, array, kinds)
                out[name] = np.asarray(array[:])
        return out

    def _direct_layout(self, acts) -> _Layout | None:
        meta = acts.metadata
        if (
            not self.fast_requested
            or getattr(meta, "zarr_format", None) != 2
            or self.compressed
            or meta.order != "C"
            or acts.dtype.byteorder == ">"
            or self.chunks[:2] != (1, 1)
            or self.chunks[3] != self.hidden_size
        ):
            return None
        fill = float(meta.fill_value) if meta.fill_value is not None else 0.0
        return _Layout(str(self.path / ACTIVATIONS), meta.dimension_separator, self.chunks[2], fill)

    def _warn(self, acts) -> None:
        if self.compressed:
            warnings.warn(
                f"{self.path}/{ACTIVATIONS} is stored with a compressor or filters: it reads "
                "correctly, but compression breaks the layout's read-performance contract "
                "(activations are high entropy; write with compressor=None, filters=None)",
                PerformanceWarning,
                stacklevel=3,
            )
        if self.chunks[:2] != (1, 1):
            warnings.warn(
                f"{self.path}/{ACTIVATIONS}: chunks {list(self.chunks)} span several samples "
                "or layers, so reading one (sample, layer) reads its neighbours too; "
                "the layout asks for (1, 1, T_chunk, H)",
                PerformanceWarning,
                stacklevel=3,
            )

    # -- pickling: handles are per process

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_group"] = state["_acts"] = None
        return state

    def _array(self):
        if self._acts is None:
            self._group = self._open()
            self._acts = self._group[ACTIVATIONS]
        return self._acts

    # -- reading

    def __len__(self) -> int:
        return self.num_samples

    @property
    def fast(self) -> bool:
        """Whether reads take the direct chunk-file path."""
        return self.layout is not None

    def read(self, i: int, layer: int, *, torch: bool = False):
        """``activations[i, layer, :seq_len[i], :]`` as a numpy array (or torch tensor)."""
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range for {self.path} ({self.num_samples})")
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range for {self.path} ({self.num_layers})")
        n = int(self.seq_len[i])
        out = self._read_direct(i, layer, n) if self.layout else self.read_zarr(i, layer, n)
        if torch:
            import torch as _torch

            return _torch.from_numpy(out)
        return out

    def read_zarr(self, i: int, layer: int, n: int | None = None) -> np.ndarray:
        """The reference path: zarr-python's own indexing."""
        n = int(self.seq_len[i]) if n is None else n
        return np.ascontiguousarray(self._array()[i, layer, :n, :])

    def _read_direct(self, i: int, layer: int, n: int) -> np.ndarray:
        layout = self.layout
        out = np.empty((n, self.hidden_size), dtype=np.float16)
        flat = memoryview(out.reshape(-1).view(np.uint8))
        row = self.hidden_size * 2
        for c in range(math.ceil(n / layout.t_chunk)):
            lo = c * layout.t_chunk * row
            hi = min(n * row, lo + layout.t_chunk * row)
            name = layout.separator.join(map(str, (i, layer, c, 0)))
            try:
                fd = os.open(f"{layout.dir}/{name}", os.O_RDONLY)
            except FileNotFoundError:  # never written: the fill value
                out.reshape(-1)[lo // 2 : hi // 2] = layout.fill
                continue
            try:
                got = os.preadv(fd, [flat[lo:hi]], 0)
            finally:
                os.close(fd)
            if got != hi - lo:
                raise ZarrStoreError(
                    f"{layout.dir}/{name}: chunk file holds {got} bytes, expected at least "
                    f"{hi - lo} (a truncated store?)"
                )
        return out

    def sample_key(self, i: int) -> str | None:
        return None if self.sample_keys is None else self.sample_keys[i].decode()

    def text(self, name: str) -> list[dict]:
        """The records of ``text/{name}`` (one JSON object per line), or []."""
        path = self.path / "text" / name
        if not path.is_file():
            return []
        with open(path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]

    def summary(self) -> str:
        return (
            f"{self.path}: Zarr activation store, {self.num_samples:,} samples x "
            f"{self.num_layers} layers, T_max {self.t_max}, H {self.hidden_size}, float16, "
            f"chunks {list(self.chunks)}, {'compressed' if self.compressed else 'uncompressed'}, "
            f"{int(self.seq_len.sum()):,} tokens"
        )


def _compressed(acts) -> bool:
    meta = acts.metadata
    if getattr(meta, "zarr_format", None) == 2:
        return meta.compressor is not None or bool(meta.filters)
    return bool(acts.compressors) or bool(acts.filters)


@dataclass(frozen=True)
class RunShard:
    shard_id: int
    path: str
    num_samples: int


class ActivationRun:
    """A sharded run read through its ``manifest.json`` (no rewrite): the same ``read``
    as ``ActivationStore`` over global sample indices, in the manifest's order.

        run = ActivationRun("run_20260122")
        x = run.read(10, 0)
    """

    def __init__(self, path: str | os.PathLike, *, fast: bool = True, warn: bool = True):
        self.path = Path(path)
        doc = load_run_manifest(self.path)
        self.manifest = doc
        self.shards = [RunShard(s["shard_id"], s["path"], s["num_samples"]) for s in doc["shards"]]
        self.stores = [
            ActivationStore(self.path / s.path, fast=fast, warn=warn) for s in self.shards
        ]
        self.num_layers = doc["num_layers"]
        self.hidden_size = doc["hidden_size"]
        self.t_max = doc["T_max"]
        for shard, store in zip(self.shards, self.stores, strict=True):
            facts = (store.num_samples, store.num_layers, store.hidden_size, store.t_max)
            expected = (shard.num_samples, self.num_layers, self.hidden_size, self.t_max)
            if facts != expected:
                raise ZarrStoreError(
                    f"{self.path / shard.path}: (samples, layers, H, T_max) = {facts}, but "
                    f"{self.path / RUN_MANIFEST} says {expected}"
                )
        by_path = {s.path: k for k, s in enumerate(self.shards)}
        samples = sorted(doc["samples"], key=lambda s: s["global_index"])
        self.shard_of = np.array([by_path[s["shard_path"]] for s in samples], dtype=np.int32)
        self.local_of = np.array([s["local_index"] for s in samples], dtype=np.int64)
        self.num_samples = len(samples)
        self.seq_len = np.array(
            [self.stores[k].seq_len[j] for k, j in zip(self.shard_of, self.local_of, strict=True)],
            dtype=np.int32,
        )
        self.attrs = dict(self.stores[0].attrs) if self.stores else {}

    def __len__(self) -> int:
        return self.num_samples

    @property
    def fast(self) -> bool:
        return all(s.fast for s in self.stores)

    def locate(self, i: int) -> tuple[ActivationStore, int]:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range for {self.path} ({self.num_samples})")
        return self.stores[self.shard_of[i]], int(self.local_of[i])

    def read(self, i: int, layer: int, *, torch: bool = False):
        store, local = self.locate(i)
        return store.read(local, layer, torch=torch)

    def read_zarr(self, i: int, layer: int) -> np.ndarray:
        store, local = self.locate(i)
        return store.read_zarr(local, layer)

    def sample_key(self, i: int) -> str | None:
        store, local = self.locate(i)
        return store.sample_key(local)

    def summary(self) -> str:
        return (
            f"{self.path}: Zarr sharded run, {len(self.shards)} shards, {self.num_samples:,} "
            f"samples x {self.num_layers} layers, T_max {self.t_max}, H {self.hidden_size}, "
            f"{int(self.seq_len.sum()):,} tokens"
        )


def load_run_manifest(path: Path) -> dict:
    """The run's ``manifest.json``, checked: every key present, every shard on disk,
    each global index exactly once, local indices inside their shard."""
    where = path / RUN_MANIFEST
    try:
        doc = json.loads(where.read_text())
    except FileNotFoundError:
        raise ZarrStoreError(f"{where}: missing (a sharded run needs its manifest)") from None
    except json.JSONDecodeError as e:
        raise ZarrStoreError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise ZarrStoreError(f"{where}: not a JSON object")
    missing = [k for k in RUN_KEYS if k not in doc]
    if missing:
        raise ZarrStoreError(f"{where}: missing key(s) {', '.join(missing)}")
    shards = doc["shards"]
    if not isinstance(shards, list) or len(shards) != doc["num_shards"]:
        raise ZarrStoreError(f"{where}: 'shards' must list num_shards={doc['num_shards']} shards")
    sizes = {}
    for k, s in enumerate(shards):
        if not isinstance(s, dict) or not {"shard_id", "path", "num_samples"} <= s.keys():
            raise ZarrStoreError(f"{where}: shards[{k}] needs shard_id, path and num_samples")
        target = (path / s["path"]).resolve()
        if not target.is_relative_to(path.resolve()):
            raise ZarrStoreError(f"{where}: shard path {s['path']!r} leaves the run directory")
        if not target.is_dir():
            raise ZarrStoreError(f"{where}: shard {s['path']!r} is missing ({target})")
        sizes[s["path"]] = s["num_samples"]
    samples = doc["samples"]
    if not isinstance(samples, list) or len(samples) != doc["total_samples"]:
        raise ZarrStoreError(
            f"{where}: 'samples' must list total_samples={doc['total_samples']} samples"
        )
    seen = np.zeros(len(samples), dtype=bool)
    for s in samples:
        if not isinstance(s, dict) or not {"global_index", "shard_path", "local_index"} <= s.keys():
            raise ZarrStoreError(f"{where}: a sample lacks global_index, shard_path or local_index")
        g, shard, local = s["global_index"], s["shard_path"], s["local_index"]
        if not isinstance(g, int) or not 0 <= g < len(samples):
            raise ZarrStoreError(f"{where}: global_index {g!r} outside [0, {len(samples)})")
        if seen[g]:
            raise ZarrStoreError(f"{where}: global_index {g} appears twice")
        seen[g] = True
        if shard not in sizes:
            raise ZarrStoreError(f"{where}: sample {g} names shard {shard!r}, not in 'shards'")
        if not isinstance(local, int) or not 0 <= local < sizes[shard]:
            raise ZarrStoreError(
                f"{where}: sample {g} has local_index {local!r} outside shard {shard!r} "
                f"({sizes[shard]} samples)"
            )
    return doc


def open_activations(
    path: str | os.PathLike, *, fast: bool = True, warn: bool = True
) -> ActivationStore | ActivationRun:
    """A store or a sharded run, whichever ``path`` holds."""
    path = Path(path)
    if is_run(path):
        return ActivationRun(path, fast=fast, warn=warn)
    if not path.exists():
        raise ZarrStoreError(f"{path}: no such file or directory")
    return ActivationStore(path, fast=fast, warn=warn)
