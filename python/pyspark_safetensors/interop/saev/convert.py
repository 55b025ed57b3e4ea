"""saev dump <-> safetensors dataset, in parallel over parts with bounded memory.

saev → safetensors: a token-level batch-mode dataset, one row per activation vector in
the dump's own order (img >> layer >> token), columns ``activation [d_vit]`` plus the
``image``, ``layer`` (the ViT layer) and ``token`` (token-axis position, 0 = CLS when the
dump has one) coordinates. Only the ``n_imgs`` images are written (never padding). Each
dataset shard holds whole images (at most ``part_bytes`` of activations), so an image's
rows are ``[img * L * T, (img + 1) * L * T)``. The manifest's metadata carries the dump's
``metadata.json`` verbatim (``saev.metadata_json``) and its hash directory name
(``saev.hash``), so converting back writes the same bytes to the same directory.

safetensors → saev: a dataset carrying that metadata (made by ``saev_to_dataset``, or
rewritten by Spark with the same rows in the same order) back to ``dump_to/<HASH>/``.

``workers > 1`` runs a pool of spawned processes: from a script, call the converters under
``if __name__ == "__main__":`` (Python's rule for process pools).
"""

from __future__ import annotations

import json
import multiprocessing
import shutil
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import numpy as np

from ...dataset import (
    MANIFEST,
    ColumnSchema,
    DatasetBuilder,
    DatasetLocation,
    Manifest,
    StagedShard,
    stage_shard,
    verify_dataset,
)
from ...dataset.publish import publishing
from ...format import SafetensorsFile, cast_array
from ..convert import ConversionError
from .dump import (
    SaevDump,
    hash_matches,
    pad_shard,
    staged_dump,
    write_metadata,
)
from .protocol import Metadata, View, parse_metadata, shard_file

PART_BYTES = 256 << 20
"""Activation bytes per dataset shard (and per worker task): bounds each worker's memory."""
COPY_BYTES = 64 << 20
"""Bytes copied at a time when writing a saev shard back."""
DTYPES = ("F32", "F16", "BF16")
META_JSON, META_HASH = "saev.metadata_json", "saev.hash"
COORDINATES = ("image", "layer", "token")


def _check_dst(dst: Path) -> None:
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ConversionError(f"{dst} already exists and is not empty; remove it or pick another")


class _NoBar:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, n: int) -> None:
        pass


def _progress_bar(total: int, desc: str, enabled: bool):
    """A tqdm byte bar (tqdm comes with the torch extra; without it, no bar)."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=not enabled, leave=False)


def _run(tasks: list[tuple], fn: Callable, workers: int, progress: bool, desc: str, total: int):
    """``fn(*task)`` for every task (each returns ``(result, bytes done)``), in a pool of
    ``workers`` processes (inline for 1), with a byte progress bar; results in task order."""
    results: list = [None] * len(tasks)
    with _progress_bar(total, desc, progress) as bar:
        if workers == 1 or len(tasks) <= 1:
            for i, task in enumerate(tasks):
                results[i], done = fn(*task)
                bar.update(done)
            return results
        ctx = multiprocessing.get_context("spawn")  # no fork of a process holding threads
        with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
            futures = {pool.submit(fn, *task): i for i, task in enumerate(tasks)}
            try:
                for future in as_completed(futures):
                    results[futures[future]], done = future.result()
                    bar.update(done)
            except BaseException:
                for f in futures:
                    f.cancel()
                raise
    return results


# -- saev -> safetensors -----------------------------------------------------------------


def _coordinates(meta: Metadata, rows: np.ndarray) -> dict[str, np.ndarray]:
    """``image``, ``layer``, ``token`` of dataset rows: the dump's own order, which is
    the ("all", "all") view of protocol §5.1."""
    coords = View(meta, "all", "all").coordinates(rows)
    return {c: coords[c] for c in COORDINATES}


def _dataset_part(
    dump_dir: str,
    location: DatasetLocation,
    name: str,
    part: int,
    start: int,
    stop: int,
    dtype: str,
) -> tuple[tuple[StagedShard, dict], int]:
    """Images ``start:stop`` of the dump as dataset shard ``part`` named ``name``; returns
    the staged shard with its column schema, and the bytes read."""
    dump = SaevDump(dump_dir)
    meta = dump.meta
    acts = dump.images(start, stop).reshape(-1, meta.d_vit)
    if dtype != "F32":
        acts = cast_array(acts, dtype, where=f"images {start}:{stop}")
    rows_per_img = meta.n_layers * meta.n_tokens_per_img
    first = start * rows_per_img
    columns = {
        "activation": acts,
        **_coordinates(meta, np.arange(first, first + len(acts), dtype=np.int64)),
    }
    staged = stage_shard(location, name, part, columns, len(acts), index=False)
    schema = {
        "activation": ColumnSchema(dtype, acts.shape, (meta.d_vit,)),
        **{c: ColumnSchema("I64", (len(acts),), ()) for c in COORDINATES},
    }
    return (staged, schema), (stop - start) * meta.img_nbytes


def saev_to_dataset(
    src: Path,
    dst: Path,
    *,
    dtype: str | None = None,
    workers: int = 1,
    progress: bool = True,
    part_bytes: int = PART_BYTES,
) -> Path:
    """Convert the saev dump at ``src`` (hash directory or its ``dump_to``) to a
    token-level dataset at ``dst`` (see the module docstring for the layout). ``dtype``:
    ``F32`` (default, lossless), ``F16`` or ``BF16`` (rounded to nearest even)."""
    dtype = (dtype or "F32").upper()
    if dtype not in DTYPES:
        raise ConversionError(f"--dtype {dtype}: a saev dump converts to one of {DTYPES}")
    dump = SaevDump(src)
    meta = dump.meta
    dst = Path(dst)
    _check_dst(dst)
    itemsize = 4 if dtype == "F32" else 2
    per_img = meta.n_layers * meta.n_tokens_per_img * meta.d_vit * itemsize
    imgs_per_part = max(1, part_bytes // per_img)
    tasks, S = [], meta.n_imgs_per_shard
    for s in range(meta.n_shards):  # parts never straddle a saev shard: one memmap each
        lo, hi = s * S, s * S + meta.imgs_in_shard(s)
        for a in range(lo, hi, imgs_per_part):
            tasks.append((str(dump.path), len(tasks), a, min(a + imgs_per_part, hi), dtype))
    text = (dump.path / "metadata.json").read_text(encoding="utf-8")
    name = dump.path.name if hash_matches(meta, dump.path.name) else meta.hash
    metadata = {
        META_JSON: text,
        META_HASH: name,
        "source_format": "saev",
        "hook_point": f"{meta.vit_ckpt} layers {list(meta.layers)}",
        "saev.rows_per_image": str(meta.n_layers * meta.n_tokens_per_img),
    }
    batch = min(imgs_per_part, max(meta.imgs_in_shard(s) for s in range(meta.n_shards)))
    created = not dst.parent.exists()
    try:
        with publishing(dst) as tmp:
            build = DatasetBuilder(
                tmp, batch_size=batch * meta.n_layers * meta.n_tokens_per_img,
                metadata=metadata, overwrite=True,
            )  # fmt: skip
            with build:
                tasks = [(t[0], build.location, build.shard_name(t[1]), *t[1:]) for t in tasks]
                parts = _run(
                    tasks, _dataset_part, workers, progress, f"saev -> {dst.name}",
                    meta.n_imgs * meta.img_nbytes,
                )  # fmt: skip
                for staged, schema in parts:
                    build.add(staged, schema)
    except BaseException:
        if created:
            shutil.rmtree(dst.parent, ignore_errors=True)
        raise
    return dst


# -- safetensors -> saev -----------------------------------------------------------------


def _dataset_rows(root: Path, manifest: Manifest, start: int, stop: int) -> Iterable[tuple]:
    """(dataset shard path, first row in shard, last row, first global row) covering
    global rows ``start:stop``."""
    first = 0
    for entry, path in zip(manifest.shards, manifest.shard_paths(root), strict=True):
        lo, hi = max(start, first), min(stop, first + entry.samples_count)
        if lo < hi:
            yield path, lo - first, hi - first, lo
        first += entry.samples_count


def _saev_shard(src: str, staging: str, s: int) -> tuple[None, int]:
    """Write saev shard ``s`` from the dataset at ``src``, checking every row's
    coordinates, then pad it to the full shard shape."""
    root = Path(src)
    manifest = verify_dataset(root)
    meta = parse_metadata(json.loads(manifest.metadata[META_JSON]), f"{root}: {META_JSON}")
    rows_per_img = meta.n_layers * meta.n_tokens_per_img
    start = s * meta.n_imgs_per_shard * rows_per_img
    stop = start + meta.imgs_in_shard(s) * rows_per_img
    step = max(1, COPY_BYTES // (meta.d_vit * 4))
    out = Path(staging) / shard_file(s)
    with open(out, "wb") as f:
        for path, lo, hi, first in _dataset_rows(root, manifest, start, stop):
            with SafetensorsFile(path) as st:
                acts, coords = st.tensor("activation"), {c: st.tensor(c) for c in COORDINATES}
                for a in range(lo, hi, step):
                    b = min(a + step, hi)
                    want = _coordinates(meta, np.arange(first + a - lo, first + b - lo))
                    for c in COORDINATES:
                        if not np.array_equal(coords[c][a:b], want[c]):
                            raise ConversionError(
                                f"{path.name}: column {c!r} of rows {a}:{b} does not follow the "
                                "dump's order img >> layer >> token; the rows were reordered"
                            )
                    chunk = acts[a:b]
                    if chunk.dtype != np.dtype("<f4"):
                        chunk = chunk.astype("<f4")
                    f.write(memoryview(np.ascontiguousarray(chunk)).cast("B"))
    pad_shard(out, meta)
    return None, (stop - start) * meta.d_vit * 4


def dataset_to_saev(
    src: Path,
    dst: Path,
    *,
    dtype: str | None = None,
    workers: int = 1,
    progress: bool = True,
) -> Path:
    """Write the dataset at ``src`` (converted from a saev dump: its manifest carries
    ``saev.metadata_json``) back as a dump in the ``dump_to`` directory ``dst``; returns
    ``dst/<HASH>``. Shards are float32, padded to the full shard shape."""
    if dtype and dtype.upper() != "F32":
        raise ConversionError(f"--dtype {dtype}: saev shards are float32 (F32) only")
    src, dst = Path(src), Path(dst)
    manifest = verify_dataset(src)
    if META_JSON not in manifest.metadata:
        raise ConversionError(
            f"{src / MANIFEST}: no {META_JSON!r} in its metadata; only datasets converted from "
            "a saev dump (pyspark-safetensors convert DUMP DST --to safetensors) convert back"
        )
    text = manifest.metadata[META_JSON]
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConversionError(
            f"{src / MANIFEST}: metadata {META_JSON!r} is not JSON ({e})"
        ) from None
    meta = parse_metadata(doc, f"{src / MANIFEST}: {META_JSON}")
    act = manifest.schema.get("activation")
    missing = [c for c in ("activation", *COORDINATES) if c not in manifest.schema]
    if missing:
        raise ConversionError(f"{src / MANIFEST}: no column(s) {missing}")
    if act.sample_shape != (meta.d_vit,):
        raise ConversionError(
            f"{src / MANIFEST}: 'activation' rows are {list(act.sample_shape)}, the dump's d_vit is {meta.d_vit}"
        )
    rows = meta.n_imgs * meta.n_layers * meta.n_tokens_per_img
    if manifest.total_samples != rows:
        raise ConversionError(
            f"{src / MANIFEST}: {manifest.total_samples} rows; n_imgs={meta.n_imgs} x "
            f"{meta.n_layers} layer(s) x {meta.n_tokens_per_img} tokens needs {rows}"
        )
    recorded = manifest.metadata.get(META_HASH, "")
    name = recorded if hash_matches(meta, recorded) else meta.hash
    with staged_dump(dst, name) as tmp:
        tasks = [(str(src), str(tmp), s) for s in range(meta.n_shards)]
        _run(tasks, _saev_shard, workers, progress, f"-> saev {name[:8]}", rows * meta.d_vit * 4)
        write_metadata(tmp, text)
    return dst / name
