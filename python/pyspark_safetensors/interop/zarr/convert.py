"""Zarr stores and runs <-> our per-sample (KV) safetensors datasets, and ``verify``.

A store becomes a KV dataset with key = ``sample_key`` (or the sample index when the
store has none) and one tensor per layer, ``layer_{l}`` ``[seq_len, H]``. Beside the
shards: ``zarr_samples.parquet`` (the global order, ``seq_len`` and every per-sample
array with its dtype), ``text/*.jsonl`` as they were, and the store's attributes in the
manifest metadata (``zarr_attrs``), so the way back restores the store.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ...dataset import DatasetBuilder, read_index, split_kv_name, verify_dataset
from ...dataset.publish import publishing
from ...format import cast_array
from .store import (
    TEXT_FILES,
    ActivationStore,
    ZarrStoreError,
    open_activations,
)
from .write import _WRITER_ATTRS, KEY_BYTES, StoreWriter, _per_sample_arrays, _text_records

SAMPLES_TABLE = "zarr_samples.parquet"
KV_SEPARATOR = "__"
SHARD_BYTES = 256 << 20
"""Target size of a KV shard written from a store (bounds the memory of one worker)."""


def layer_column(layer: int) -> str:
    return f"layer_{layer}"


def zarr_to_dataset(
    src: Path, dst: Path, *, dtype: str | None = None, workers: int = 1, progress: bool = True
) -> Path:
    """A store or a sharded run -> a KV dataset at ``dst`` (see the module docstring).
    ``dtype`` (default F16, the store's) may be F32 or BF16."""
    from tqdm.auto import tqdm

    dtype = (dtype or "F16").upper()
    if dtype not in ("F16", "F32", "BF16"):
        raise ZarrStoreError(f"--dtype {dtype}: choose F16, BF16 or F32")
    source = open_activations(src)
    arrays = _per_sample_arrays(source)
    keys = _sample_keys(src, source, arrays)
    sample_bytes = source.seq_len.astype(np.int64) * source.num_layers * source.hidden_size * 2
    groups = _groups(sample_bytes * (2 if dtype == "F32" else 1), SHARD_BYTES)
    columns = [layer_column(layer) for layer in range(source.num_layers)]
    attrs = dict(source.attrs)
    metadata = {
        "source_format": "zarr",
        "zarr_attrs": json.dumps(attrs, sort_keys=True),
        "layers": json.dumps(columns),
        "model_id": str(attrs.get("model_id", "")),
    }

    with publishing(dst) as tmp:
        build = DatasetBuilder(
            tmp, mode="kv", name_col="sample_key", kv_separator=KV_SEPARATOR,
            metadata=metadata, overwrite=True,
        )  # fmt: skip

        def write(part: int) -> int:
            samples = {
                keys[i]: {
                    column: cast_array(
                        source.read(int(i), layer), dtype, where=f"sample {i} layer {layer}"
                    )
                    for layer, column in enumerate(columns)
                }
                for i in groups[part]
            }
            build.add_kv(samples, part=part, shard_metadata={"format": "pt", **metadata})
            return len(samples)

        with (
            build,
            ThreadPoolExecutor(max(1, workers)) as pool,
            tqdm(total=len(source), desc="zarr -> safetensors", unit="sample",
                 disable=not progress) as bar,
        ):  # fmt: skip
            for count in pool.map(write, range(len(groups))):
                bar.update(count)
        _write_samples_table(tmp, source, arrays, keys)
        _write_texts(tmp, source)
    return dst


def _sample_keys(src: Path, source, arrays: dict) -> list[str]:
    """The dataset keys: the store's ``sample_key`` (unique), else the sample index."""
    keys = (
        [k.decode() for k in arrays["sample_key"]]
        if "sample_key" in arrays
        else [str(i) for i in range(len(source))]
    )
    if len(set(keys)) != len(keys):
        dup = next(k for k in keys if keys.count(k) > 1)
        raise ZarrStoreError(f"{src}: sample_key {dup!r} appears twice; keys must be unique")
    return keys


def _write_samples_table(tmp: Path, source, arrays: dict, keys: list[str]) -> None:
    """``zarr_samples.parquet``: the global order, ``seq_len`` and every per-sample array."""
    table = {"i": pa.array(np.arange(len(source), dtype=np.int64))}
    if "sample_key" in arrays:
        table["sample_key"] = pa.array(keys, pa.string())
    table["seq_len"] = pa.array(source.seq_len)
    for name, values in arrays.items():
        if name != "sample_key":
            table[name] = pa.array(values)
    pq.write_table(pa.table(table), tmp / SAMPLES_TABLE)


def _write_texts(tmp: Path, source) -> None:
    """The store's ``text/*.jsonl`` records, as they were."""
    for name, records in _text_records(source).items():
        (tmp / "text").mkdir(exist_ok=True)
        with open(tmp / "text" / name, "w", encoding="utf-8") as f:
            for g in sorted(records):
                f.write(json.dumps(records[g], ensure_ascii=False) + "\n")


def _groups(sizes: np.ndarray, target: int) -> list[np.ndarray]:
    """Consecutive runs of samples of about ``target`` bytes (at least one sample each)."""
    groups, start, total = [], 0, 0
    for i, size in enumerate(sizes.tolist()):
        if i > start and total + size > target:
            groups.append(np.arange(start, i))
            start, total = i, 0
        total += size
    if start < len(sizes):
        groups.append(np.arange(start, len(sizes)))
    return groups


def dataset_to_zarr(
    src: Path, dst: Path, *, dtype: str | None = None, workers: int = 1, progress: bool = True
) -> Path:
    """A KV dataset (one ``[seq_len, H]`` tensor per layer column and key) -> a store.

    Layers are the columns in the order of the manifest metadata ``layers`` (written by
    ``zarr_to_dataset``) or of the schema; keys become ``sample_key`` (at most 64 bytes)
    in the order of ``zarr_samples.parquet`` when present, else the index's. F32/BF16
    tensors are rounded to float16 (nearest even)."""
    from tqdm.auto import tqdm

    if dtype not in (None, "F16", "float16"):
        raise ZarrStoreError(f"--dtype {dtype}: a Zarr activation store is float16 only")
    manifest = verify_dataset(src)
    layers, hidden = _layers(src, manifest)
    where = _tensor_locations(src, manifest)
    samples = pq.read_table(src / SAMPLES_TABLE) if (src / SAMPLES_TABLE).is_file() else None
    if samples is not None and "sample_key" in samples.column_names:
        keys = samples.column("sample_key").to_pylist()
    elif samples is not None:
        keys = [str(i) for i in samples.column("i").to_pylist()]
    else:
        keys = list(where)
    write_keys = samples is None or "sample_key" in samples.column_names
    seq_lens = _sequence_lengths(src, where, keys, layers, write_keys)
    attrs = json.loads(manifest.metadata.get("zarr_attrs", "{}"))
    t_max = int(attrs.get("T_max") or max(seq_lens, default=1) or 1)
    if seq_lens and max(seq_lens) > t_max:
        raise ZarrStoreError(f"{src}: a sample has {max(seq_lens)} tokens > T_max {t_max}")
    extra = {k: v for k, v in attrs.items() if k not in _WRITER_ATTRS and k != "model_id"}
    writer = StoreWriter(
        dst, num_layers=len(layers), hidden_size=hidden, t_max=t_max,
        model_id=str(attrs.get("model_id", manifest.metadata.get("model_id", ""))),
        num_samples=len(keys), attrs=extra, t_chunk=_chunk_of(attrs, t_max),
    )  # fmt: skip
    values = {}
    if samples is not None:
        values = {
            name: samples.column(name).to_numpy()
            for name in samples.column_names
            if name not in ("i", "sample_key", "seq_len")
        }

    def copy(i: int) -> None:
        acts = np.empty((len(layers), seq_lens[i], hidden), np.float16)
        for layer, column in enumerate(layers):
            file, shape, dt, begin, end = where[keys[i]][column]
            acts[layer] = _read_tensor(src / file, begin, end, dt, shape)
        writer.put(
            i, acts, sample_key=keys[i] if write_keys else None,
            **{name: column[i] for name, column in values.items()},
        )  # fmt: skip

    try:
        with (
            ThreadPoolExecutor(max(1, workers)) as pool,
            tqdm(total=len(keys), desc="safetensors -> zarr", unit="sample",
                 disable=not progress) as bar,
        ):  # fmt: skip
            for _ in pool.map(copy, range(len(keys))):
                bar.update()
        _read_texts(src, writer)
    except BaseException:
        writer.abort()
        raise
    return writer.close()


def _layers(src: Path, manifest) -> tuple[list[str], int]:
    """The layer columns in store order and their common hidden size."""
    if manifest.mode != "kv" or manifest.index_file is None:
        raise ZarrStoreError(
            f"{src}: a Zarr store is made from a KV dataset with a tensor index "
            "(one tensor per sample and layer); this one is a batch dataset"
        )
    layers = json.loads(manifest.metadata.get("layers", "null")) or list(manifest.schema)
    widths = {c: manifest.schema[c].sample_shape[-1] for c in layers if c in manifest.schema}
    if len(widths) != len(layers) or len(set(widths.values())) != 1:
        raise ZarrStoreError(
            f"{src}: every layer column needs the same hidden size; columns {widths}"
        )
    return layers, next(iter(widths.values()))


def _tensor_locations(src: Path, manifest) -> dict[str, dict[str, tuple]]:
    """``{key: {column: (file, shape, dtype, begin, end)}}`` from the tensor index, names
    split by the writer's own rule."""
    sep = manifest.kv_separator or KV_SEPARATOR
    where: dict[str, dict[str, tuple]] = {}
    table = read_index(src, manifest).to_pydict()
    for name, file, shape, dt, begin, end in zip(
        table["tensor_key"], table["file_name"], table["shape"], table["dtype"],
        table["begin"], table["end"], strict=True,
    ):  # fmt: skip
        split = split_kv_name(name, manifest.schema, sep)
        if split is None:
            raise ZarrStoreError(f"{src}: tensor {name!r} names no column of the dataset")
        key, column = split
        where.setdefault(key, {})[column] = (file, tuple(shape), dt, begin, end)
    return where


def _sequence_lengths(src: Path, where, keys, layers, write_keys: bool) -> list[int]:
    """Each key's token count, checking it has every layer, all ``[seq_len, H]``, and a
    key that fits ``sample_key`` when keys are written."""
    seq_lens = []
    for key in keys:
        entry = where.get(key)
        if entry is None or set(entry) != set(layers):
            raise ZarrStoreError(
                f"{src}: key {key!r} has layers {sorted(entry or {})}, expected {layers}"
            )
        lengths = {c: entry[c][1][0] for c in layers}
        if len(set(lengths.values())) != 1 or any(len(entry[c][1]) != 2 for c in layers):
            raise ZarrStoreError(f"{src}: key {key!r} has layers of different shapes {lengths}")
        seq_lens.append(lengths[layers[0]])
        if write_keys and len(key.encode()) > KEY_BYTES:
            raise ZarrStoreError(
                f"{src}: key {key[:20]!r}... is longer than {KEY_BYTES} bytes; sample_key "
                "cannot hold it"
            )
    return seq_lens


def _read_texts(src: Path, writer: StoreWriter) -> None:
    """The dataset's ``text/*.jsonl`` records into the store's text files."""
    for name in TEXT_FILES:
        path = src / "text" / name
        if path.is_file():
            with open(path, encoding="utf-8") as f:
                for line in f:
                    if line.strip():
                        record = json.loads(line)
                        writer.texts[name][record["i"]] = record


def _chunk_of(attrs: dict, t_max: int) -> int | None:
    """The source store's ``T_chunk`` when it recorded a usable one (chunking is kept)."""
    chunk = attrs.get("T_chunk")
    return chunk if isinstance(chunk, int) and 1 <= chunk <= t_max else None


def _read_tensor(path: Path, begin: int, end: int, dtype: str, shape) -> np.ndarray:
    from ...format import get_dtype

    with open(path, "rb") as f:
        raw = os.pread(f.fileno(), end - begin, begin)
    x = np.frombuffer(raw, dtype=get_dtype(dtype).numpy).reshape(shape)
    return cast_array(x, "F16", where=f"{path}")


def verify_store(path: str | os.PathLike) -> str:
    """One line describing a store or a run, after checking its layout, every array it
    needs and (uncompressed stores) the size of every chunk file; raises
    ``ZarrStoreError`` naming the problem otherwise."""
    source = open_activations(path)
    for store in getattr(source, "stores", [source]):
        _check_chunk_files(store)
    return source.summary()


def _check_chunk_files(store: ActivationStore) -> None:
    if store.layout is None:
        return
    layout = store.layout
    size = layout.t_chunk * store.hidden_size * 2
    for i, n in enumerate(store.seq_len.tolist()):
        for layer in range(store.num_layers):
            for c in range(-(-n // layout.t_chunk)):
                name = layout.separator.join(map(str, (i, layer, c, 0)))
                try:
                    got = os.stat(f"{layout.dir}/{name}").st_size
                except FileNotFoundError:
                    continue  # never written: the fill value
                if got != size:
                    raise ZarrStoreError(
                        f"{layout.dir}/{name}: {got} bytes, an uncompressed chunk is {size}"
                    )


def saev_to_zarr(
    src: Path, dst: Path, *, dtype: str | None = None, workers: int = 1, progress: bool = True
) -> Path:
    """A saev dump -> a store: image ``i`` is sample ``i``, its ``(L, T, d_vit)`` float32
    activations rounded to float16 (nearest even), ``seq_len`` = tokens per image (CLS
    included when the dump has it); the dump's ``metadata.json`` is kept in the
    attributes (``saev_metadata``) with its layers and hash."""
    from tqdm.auto import tqdm

    from ..saev import SaevDump

    if dtype not in (None, "F16", "float16"):
        raise ZarrStoreError(f"--dtype {dtype}: a Zarr activation store is float16 only")
    dump = SaevDump(src)
    meta = dump.meta
    writer = StoreWriter(
        dst, num_layers=meta.n_layers, hidden_size=meta.d_vit, t_max=meta.n_tokens_per_img,
        model_id=f"{meta.vit_family}/{meta.vit_ckpt}", num_samples=meta.n_imgs,
        attrs={"source_format": "saev", "saev_metadata": meta.doc, "saev_hash": dump.path.name,
               "layers": list(meta.layers), "cls_token": meta.cls_token},
    )  # fmt: skip

    def copy(shard: int) -> int:
        first = shard * meta.n_imgs_per_shard
        images = dump.shard(shard)
        for j in range(len(images)):
            writer.put(first + j, images[j])
        return len(images)

    try:
        with (
            ThreadPoolExecutor(max(1, workers)) as pool,
            tqdm(total=meta.n_imgs, desc="saev -> zarr", unit="image", disable=not progress) as bar,
        ):
            for count in pool.map(copy, range(meta.n_shards)):
                bar.update(count)
    except BaseException:
        writer.abort()
        raise
    return writer.close()


__all__ = ["dataset_to_zarr", "layer_column", "saev_to_zarr", "verify_store", "zarr_to_dataset"]
