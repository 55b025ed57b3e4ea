"""Writing Zarr activation stores and sharded runs, and merging a run into one store.

One writer owns one store (the layout never has two processes append to one array); W
writers make W shards of a run, and the run's ``manifest.json``, written last, maps global
sample indices to ``(shard_path, local_index)``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from ...dataset.manifest import write_json_atomic
from ...dataset.publish import publish, staging_path
from .store import (
    ACTIVATIONS,
    RUN_MANIFEST,
    SCHEMA_VERSION,
    SEQ_LEN,
    TEXT_FILES,
    ActivationRun,
    ZarrStoreError,
    load_run_manifest,
    token_chunk,
)

PER_SAMPLE_DTYPES = {
    "prompt_len": np.int32,
    "response_len": np.int32,
    "hallu_label": np.int8,
    "split": np.int8,
}
"""The optional per-sample arrays a writer takes, with their stored dtypes."""
KEY_BYTES = 64
_TEXT_FIELD = {"prompts.jsonl": "prompt", "responses.jsonl": "response"}
_WRITER_ATTRS = ("schema_version", "num_layers", "hidden_size", "T_max", "dtype", "T_chunk",
                 "chunk_shape", "chunk_bytes")  # fmt: skip


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def shard_path(shard_id: int) -> str:
    """A shard's path inside its run directory."""
    return f"shards/shard-{shard_id:04d}.zarr"


class StoreWriter:
    """Write one activation store, sample by sample; it appears at ``path`` whole on
    ``close()`` (built under a staging name, metadata consolidated, then published).

        with StoreWriter("acts.zarr", num_layers=L, hidden_size=H, t_max=512,
                         model_id="gpt2") as w:
            w.add(acts_LTH, sample_key="ab12...", prompt="Hi", prompt_len=3)

    ``acts`` is ``(L, seq_len, H)``: float16 is stored as is, other floats rounded to
    nearest even. Each layer is written as whole chunks (padded with the fill value to
    the chunk boundary), so no chunk is read back and rewritten: by default straight into
    the chunk files (the array is uncompressed, C order, little-endian, so a chunk file
    is the chunk's bytes), or with ``direct=False`` through zarr-python (its twin; the
    tests check both write the same files). ``num_samples`` known up front pre-allocates
    the arrays; otherwise they grow and are trimmed at close.
    Per-sample values (``sample_key``, ``prompt_len``, ``response_len``, ``hallu_label``,
    ``split``) are stored as arrays when given for every sample; text goes to
    ``text/*.jsonl``; ``attrs`` joins the global metadata (never per-sample data).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        num_layers: int,
        hidden_size: int,
        t_max: int,
        model_id: str = "",
        num_samples: int | None = None,
        t_chunk: int | None = None,
        attrs: dict | None = None,
        direct: bool = True,
    ):
        import zarr

        if min(num_layers, hidden_size, t_max) < 1:
            raise ZarrStoreError(
                f"{path}: num_layers, hidden_size and t_max must be >= 1 "
                f"(got {num_layers}, {hidden_size}, {t_max})"
            )
        self.path = Path(path)
        self.num_layers, self.hidden_size, self.t_max = num_layers, hidden_size, t_max
        self.t_chunk = t_chunk or token_chunk(t_max, hidden_size)
        if not 1 <= self.t_chunk <= t_max:
            raise ZarrStoreError(f"{path}: t_chunk {self.t_chunk} outside [1, T_max={t_max}]")
        self.fixed = num_samples is not None
        self.capacity = num_samples if self.fixed else 256
        self.count = 0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.staging = staging_path(self.path)
        self.group = zarr.open_group(str(self.staging), mode="w", zarr_format=2)
        self.acts = self.group.create_array(
            ACTIVATIONS,
            shape=(self.capacity, num_layers, t_max, hidden_size),
            chunks=(1, 1, self.t_chunk, hidden_size),
            dtype="<f2",
            compressors=None,
            filters=None,
            fill_value=0,
            order="C",
        )
        self.seq_len = np.zeros(self.capacity, np.int32)
        self.written = np.zeros(self.capacity, bool)
        self.lock = threading.Lock()  # put() may run on several threads
        self.values: dict[str, np.ndarray] = {}
        self.given: dict[str, np.ndarray] = {}
        self.texts: dict[str, dict[int, dict]] = {name: {} for name in TEXT_FILES}
        self.attrs = {
            "schema_version": SCHEMA_VERSION,
            "model_id": model_id,
            **(attrs or {}),
            "num_layers": num_layers,
            "hidden_size": hidden_size,
            "T_max": t_max,
            "dtype": "float16",
            "T_chunk": self.t_chunk,
            "chunk_shape": [1, 1, self.t_chunk, hidden_size],
            "chunk_bytes": self.t_chunk * hidden_size * 2,
        }
        self.closed = False
        self.direct = direct
        self.chunk_dir = self.staging / ACTIVATIONS

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(self, kind, value, tb) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()

    def add(self, acts, **sample) -> int:
        """Append one sample (see ``put``); returns its index."""
        i = self.count
        if i == self.capacity:
            if self.fixed:
                raise ZarrStoreError(f"{self.path}: more than num_samples={self.capacity} samples")
            self._grow(max(2 * self.capacity, 256))
        self.put(i, acts, **sample)
        return i

    def put(
        self,
        i: int,
        acts,
        *,
        sample_key: str | bytes | None = None,
        prompt: str | None = None,
        response: str | None = None,
        extra: dict | None = None,
        **values,
    ) -> None:
        """Write sample ``i`` (distinct indices may be written from several threads)."""
        acts = _half(acts, f"{self.path} sample {i}")
        if acts.ndim != 3 or acts.shape[0] != self.num_layers or acts.shape[2] != self.hidden_size:
            raise ZarrStoreError(
                f"{self.path}: sample {i} has activations of shape {list(acts.shape)}; "
                f"expected (L={self.num_layers}, seq_len, H={self.hidden_size})"
            )
        n = acts.shape[1]
        if n > self.t_max:
            raise ZarrStoreError(f"{self.path}: sample {i} has seq_len {n} > T_max {self.t_max}")
        if not 0 <= i < self.capacity:
            raise ZarrStoreError(f"{self.path}: sample index {i} outside [0, {self.capacity})")
        unknown = set(values) - set(PER_SAMPLE_DTYPES)
        if unknown:
            raise ZarrStoreError(
                f"{self.path}: unknown per-sample value(s) {sorted(unknown)}; arrays are "
                f"{sorted(PER_SAMPLE_DTYPES)} (put anything else in extra=)"
            )
        whole = math.ceil(n / self.t_chunk) * self.t_chunk  # rows of the chunks touched
        if n:
            if whole != n:
                block = np.zeros((self.num_layers, whole, self.hidden_size), np.float16)
                block[:, :n] = acts
                acts = block
            if self.direct:
                self._write_chunks(i, acts)
            else:
                self.acts[i, :, : min(whole, self.t_max), :] = acts[:, : self.t_max]
        self.seq_len[i] = n
        key = sample_key.encode() if isinstance(sample_key, str) else sample_key
        if key is not None:
            if len(key) > KEY_BYTES:
                raise ZarrStoreError(
                    f"{self.path}: sample {i} key {key[:16]!r}... is {len(key)} bytes; "
                    f"sample_key holds at most {KEY_BYTES} (use a hash, e.g. sha256 hex)"
                )
            self._value("sample_key", f"|S{KEY_BYTES}")[i] = key
        for name, value in values.items():
            if value is not None:
                self._value(name, PER_SAMPLE_DTYPES[name])[i] = value
        key_text = None if key is None else key.decode()
        for name, field in _TEXT_FIELD.items():
            text = prompt if field == "prompt" else response
            if text is not None:
                self.texts[name][i] = {"i": i, "sample_key": key_text, field: text}
        if extra:
            self.texts["extra_metadata.jsonl"][i] = {"i": i, "sample_key": key_text, **extra}
        with self.lock:
            self.written[i] = True
            self.count = max(self.count, i + 1)

    def _write_chunks(self, i: int, acts: np.ndarray) -> None:
        """Each ``(1, 1, T_chunk, H)`` chunk of sample ``i`` as its v2 chunk file
        ``{i}.{l}.{c}.0`` (an edge chunk is stored whole, padded, as zarr stores it)."""
        step = self.t_chunk
        for layer in range(self.num_layers):
            for c in range(acts.shape[1] // step):
                chunk = np.ascontiguousarray(acts[layer, c * step : (c + 1) * step])
                with open(self.chunk_dir / f"{i}.{layer}.{c}.0", "wb") as f:
                    f.write(memoryview(chunk).cast("B"))

    def _value(self, name: str, dtype) -> np.ndarray:
        if name not in self.values:
            with self.lock:
                if name not in self.values:
                    self.given[name] = np.zeros(self.capacity, bool)
                    self.values[name] = np.zeros(self.capacity, dtype)
        return _Marked(self.values[name], self.given[name])

    def _grow(self, capacity: int) -> None:
        self.acts.resize((capacity, *self.acts.shape[1:]))
        self.seq_len = np.resize(self.seq_len, capacity)
        self.seq_len[self.capacity :] = 0
        self.written = _extend(self.written, capacity)
        for name in self.values:
            self.values[name] = _extend(self.values[name], capacity)
            self.given[name] = _extend(self.given[name], capacity)
        self.capacity = capacity

    def close(self) -> Path:
        """Write the per-sample arrays, text and attributes, consolidate, publish."""
        import zarr

        if self.closed:
            return self.path
        try:
            n = self.count if not self.fixed else self.capacity
            if self.fixed and not self.written.all():
                raise ZarrStoreError(
                    f"{self.path}: {int(self.written.sum())} of num_samples={self.capacity} "
                    f"samples written (sample {int(np.argmin(self.written))} is missing)"
                )
            if n != self.acts.shape[0]:
                self.acts.resize((n, *self.acts.shape[1:]))
            self._array(SEQ_LEN, self.seq_len[:n])
            for name, values in self.values.items():
                missing = np.flatnonzero(~self.given[name][:n])
                if len(missing):
                    raise ZarrStoreError(
                        f"{self.path}: {name} given for some samples but not sample "
                        f"{int(missing[0])}; give it for every sample or none"
                    )
                self._array(f"arrays/{name}", values[:n])
            self.group.attrs.update({"created_at": now(), **self.attrs})
            zarr.consolidate_metadata(str(self.staging))
            # text after consolidating: zarr warns about non-Zarr folders in a hierarchy
            for name, records in self.texts.items():
                if records:
                    (self.staging / "text").mkdir(exist_ok=True)
                    with open(self.staging / "text" / name, "w", encoding="utf-8") as f:
                        for i in sorted(records):
                            f.write(json.dumps(records[i], ensure_ascii=False) + "\n")
            publish(self.staging, self.path)
            self.closed = True
            return self.path
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """Delete everything written; nothing appears at ``path``."""
        self.closed = True
        shutil.rmtree(self.staging, ignore_errors=True)

    def _array(self, name: str, values: np.ndarray) -> None:
        array = self.group.create_array(
            name,
            shape=values.shape,
            chunks=(max(1, len(values)),),
            dtype=values.dtype,
            compressors=None,
            filters=None,
            fill_value=b"" if values.dtype.kind == "S" else 0,
        )
        if len(values):
            array[:] = values


class _Marked:
    """Assignment into a per-sample array that also records which samples got a value."""

    def __init__(self, values: np.ndarray, given: np.ndarray):
        self.values, self.given = values, given

    def __setitem__(self, i: int, value) -> None:
        self.values[i] = value
        self.given[i] = True


def _extend(a: np.ndarray, capacity: int) -> np.ndarray:
    out = np.zeros(capacity, a.dtype)
    out[: len(a)] = a
    return out


def _half(acts, where: str) -> np.ndarray:
    from ...format import to_f16

    if hasattr(acts, "detach"):  # a torch tensor
        acts = acts.detach().cpu()
        acts = acts.float().numpy() if str(acts.dtype) == "torch.bfloat16" else acts.numpy()
    acts = np.asarray(acts)
    if acts.dtype == np.float16:
        return acts
    if acts.dtype.kind != "f":
        raise ZarrStoreError(f"{where}: activations of dtype {acts.dtype}; expected floats")
    return to_f16(acts.astype(np.float32, copy=False))


def write_run_manifest(
    run_dir: str | os.PathLike,
    placement: Sequence[tuple[int, int]],
    *,
    created_at: str | None = None,
) -> dict:
    """Write ``run_dir/manifest.json`` for the shards under ``run_dir/shards/``, sample
    ``g`` being local sample ``placement[g][1]`` of shard ``placement[g][0]``; the global
    facts come from the shards' attributes (which must agree). Written last and
    atomically: the run exists once this returns. Returns the document."""
    import zarr

    run_dir = Path(run_dir)
    ids = sorted({shard for shard, _ in placement})
    shards, facts = [], None
    for shard_id in ids:
        path = shard_path(shard_id)
        try:
            group = zarr.open_group(str(run_dir / path), mode="r")
        except Exception as e:
            raise ZarrStoreError(f"{run_dir / path}: cannot open the shard ({e})") from e
        attrs = dict(group.attrs)
        mine = tuple(attrs.get(k) for k in ("model_id", "num_layers", "hidden_size", "T_max"))
        if facts is not None and mine != facts:
            raise ZarrStoreError(
                f"{run_dir / path}: (model_id, L, H, T_max) = {mine}, other shards say {facts}"
            )
        facts = mine
        shards.append(
            {"shard_id": shard_id, "path": path, "num_samples": group[ACTIVATIONS].shape[0]}
        )
    if facts is None:
        raise ZarrStoreError(f"{run_dir}: a run needs at least one sample")
    doc = {
        "schema_version": SCHEMA_VERSION,
        "model_id": facts[0],
        "num_layers": facts[1],
        "hidden_size": facts[2],
        "T_max": facts[3],
        "dtype": "float16",
        "created_at": created_at or now(),
        "num_shards": len(shards),
        "total_samples": len(placement),
        "shards": shards,
        "samples": [
            {"global_index": g, "shard_path": shard_path(shard), "local_index": int(local)}
            for g, (shard, local) in enumerate(placement)
        ],
    }
    write_json_atomic(run_dir / RUN_MANIFEST, doc)
    try:
        load_run_manifest(run_dir)
    except ZarrStoreError:
        (run_dir / RUN_MANIFEST).unlink()
        raise
    return doc


def copy_store_into(
    writer: StoreWriter,
    source,
    *,
    workers: int = 1,
    progress: bool = False,
    desc: str = "copy",
) -> None:
    """Copy every sample of ``source`` (an ``ActivationStore`` or ``ActivationRun``) into
    ``writer`` at the same index, with its per-sample arrays and text records; ``workers``
    threads copy disjoint samples (one chunk file per (sample, layer, token chunk))."""
    from tqdm.auto import tqdm

    arrays = _per_sample_arrays(source)
    texts = _text_records(source)

    def copy(i: int) -> None:
        acts = np.stack([source.read(i, layer) for layer in range(source.num_layers)])
        values = {name: column[i] for name, column in arrays.items() if name != "sample_key"}
        key = arrays["sample_key"][i] if "sample_key" in arrays else None
        writer.put(i, acts, sample_key=key, **values)
        for name, records in texts.items():
            if i in records:
                writer.texts[name][i] = {**records[i], "i": i}

    with (
        ThreadPoolExecutor(max(1, workers)) as pool,
        tqdm(total=len(source), desc=desc, unit="sample", disable=not progress) as bar,
    ):
        for _ in pool.map(copy, range(len(source))):
            bar.update()


def _per_sample_arrays(source) -> dict[str, np.ndarray]:
    """Per-sample arrays in the source's global order (a run: through its manifest)."""
    stores = getattr(source, "stores", None)
    if stores is None:
        out = dict(source.arrays)
        if source.sample_keys is not None:
            out["sample_key"] = source.sample_keys
        return out
    names = set.intersection(
        *({*s.arrays, *(["sample_key"] if s.sample_keys is not None else [])} for s in stores)
    )
    out = {}
    for name in sorted(names):
        columns = [s.sample_keys if name == "sample_key" else s.arrays[name] for s in stores]
        out[name] = np.array(
            [columns[k][j] for k, j in zip(source.shard_of, source.local_of, strict=True)],
            dtype=columns[0].dtype,
        )
    return out


def _text_records(source) -> dict[str, dict[int, dict]]:
    """``{file: {global index: record}}`` of the source's ``text/*.jsonl``."""
    stores = getattr(source, "stores", None)
    out: dict[str, dict[int, dict]] = {}
    for name in TEXT_FILES:
        if stores is None:
            records = {r["i"]: r for r in source.text(name)}
        else:
            local = [{r["i"]: r for r in s.text(name)} for s in stores]
            records = {}
            for g, (k, j) in enumerate(zip(source.shard_of, source.local_of, strict=True)):
                if int(j) in local[k]:
                    records[g] = {**local[k][int(j)], "i": g}
        if records:
            out[name] = records
    return out


def merge_run(
    src: Path, dst: Path, *, dtype: str | None = None, workers: int = 1, progress: bool = True
) -> Path:
    """A sharded run -> one store at ``dst`` in the manifest's global order, with the
    shards' chunking, per-sample arrays, text and attributes (the layout's Option B)."""
    if dtype not in (None, "F16", "float16"):
        raise ZarrStoreError(f"--dtype {dtype}: a Zarr activation store is float16 only")
    run = ActivationRun(src)
    first = run.stores[0]
    attrs = {k: v for k, v in first.attrs.items() if k not in _WRITER_ATTRS}
    writer = StoreWriter(
        dst, num_layers=run.num_layers, hidden_size=run.hidden_size, t_max=run.t_max,
        model_id=attrs.pop("model_id", run.manifest["model_id"]), num_samples=len(run),
        t_chunk=first.chunks[2], attrs=attrs,
    )  # fmt: skip
    try:
        copy_store_into(writer, run, workers=workers, progress=progress, desc="merge")
    except BaseException:
        writer.abort()
        raise
    return writer.close()


__all__ = [
    "KEY_BYTES",
    "StoreWriter",
    "copy_store_into",
    "merge_run",
    "shard_path",
    "write_run_manifest",
]
