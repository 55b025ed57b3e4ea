"""saev dumps: reading them directly vs the same data as our dataset, and conversion speed.

One dump of ~0.8 GB (float32, 1,500 images x 1 layer x 257 tokens x 512, 5 shards, the
last one zero-padded as saev writes it), converted once to our F32 dataset; page cache
warm. Measured in the same run:

- random access to one activation vector: ``np.memmap`` indexing into the shard (what
  saev's reader does) vs our ``SafetensorsDataset`` (``ds[i]``, one row of every column,
  and ``read_rows`` of the activation alone); p50 latency over 20,000 random rows;
- shuffled training batches of 4096 rows (float32 torch tensors, GB/s of output) from the
  saev view (``open_saev``) and from our dataset, both through ``ShuffledBatches``;
- conversion throughput (GB of activations per second) with 1 and 2 worker processes,
  both directions, against copying the same shard files and syncing them to disk (the
  converters fsync what they write).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import table

N_IMGS, PATCHES, D = 1500, 256, 512
IMGS_PER_SHARD = 320
BATCH = 4096
LOOKUPS = 20_000


def make_dump(dump_to: Path) -> Path:
    from pyspark_safetensors.interop.saev import DumpWriter, new_metadata

    T = PATCHES + 1
    meta = new_metadata(
        vit_family="clip", vit_ckpt="ViT-B-16/openai", layers=[-2], n_patches_per_img=PATCHES,
        cls_token=True, d_vit=D, seed=0, n_imgs=N_IMGS, max_patches_per_shard=IMGS_PER_SHARD * T,
        data={"type": "Synthetic", "n": N_IMGS},
    )  # fmt: skip
    rng = np.random.default_rng(0)
    with DumpWriter(dump_to, meta) as w:
        for a in range(0, N_IMGS, 100):
            w.write(rng.standard_normal((min(100, N_IMGS - a), 1, T, D), dtype=np.float32))
    return w.path


def p50_us(fn, indices) -> float:
    times = np.empty(len(indices))
    for k, i in enumerate(indices):
        start = time.perf_counter_ns()
        fn(int(i))
        times[k] = time.perf_counter_ns() - start
    return float(np.median(times)) / 1e3


def lookups(dump_dir: Path, ds_dir: Path) -> list[list[str]]:
    from pyspark_safetensors.interop.saev import SaevDump
    from pyspark_safetensors.torch import open_dataset

    dump, ds = SaevDump(dump_dir), open_dataset(ds_dir)
    T, S = PATCHES + 1, IMGS_PER_SHARD
    maps = [dump.shard(s) for s in range(dump.meta.n_shards)]
    rows = np.random.default_rng(1).integers(0, N_IMGS * T, LOOKUPS)

    def saev_memmap(i):
        img, token = divmod(i, T)
        return np.array(maps[img // S][img % S, 0, token])

    def ours_row(i):
        return ds[i]

    def ours_activation(i):
        shard, row = ds.locate(i)
        return ds.read_rows(shard, "activation", np.array([row]))

    for fn in (saev_memmap, ours_row, ours_activation):  # warm
        p50_us(fn, rows[:2000])
    base = p50_us(saev_memmap, rows)
    out = [["one vector: saev `np.memmap[img, layer, token]`", f"{base:.1f} µs", ""]]
    for name, fn in [
        ("one vector: ours `ds[i]` (4 columns)", ours_row),
        ("one vector: ours `read_rows(shard, 'activation', [row])`", ours_activation),
    ]:
        t = p50_us(fn, rows)
        out.append([name, f"{t:.1f} µs", f"{t / base:.1f}× the memmap's time"])
    return out


def shuffled(dataset) -> float:
    from pyspark_safetensors.torch import ShuffledBatches

    batches = ShuffledBatches(dataset, BATCH, columns=["activation"], seed=0)
    start, total = time.perf_counter(), 0
    for b in batches:
        total += b["activation"].numel() * 4
    return total / (time.perf_counter() - start) / 1e9


def copy_synced(src: Path, dst: Path) -> None:
    """The floor of any converter: the same bytes copied and synced to disk (the
    converters fsync what they write)."""
    shutil.copyfile(src, dst)
    with open(dst, "rb+") as f:
        os.fsync(f.fileno())


def timed(fn) -> float:
    os.sync()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run() -> str:
    from pyspark_safetensors.interop.saev import dataset_to_saev, open_saev, saev_to_dataset
    from pyspark_safetensors.torch import open_dataset

    out = Path(tempfile.mkdtemp(prefix="bench-saev-"))
    try:
        dump_dir = make_dump(out / "shards")
        data_bytes = N_IMGS * (PATCHES + 1) * D * 4
        ds_dir = saev_to_dataset(dump_dir, out / "ds", progress=False)
        rows = lookups(dump_dir, ds_dir)

        saev_view, ours_ds = open_saev(dump_dir, patches="all"), open_dataset(ds_dir)
        shuffled(saev_view), shuffled(ours_ds)  # warm
        from_saev, from_ours = shuffled(saev_view), shuffled(ours_ds)
        rows.append(
            ["shuffled batches of 4096: saev view (`open_saev`)", f"{from_saev:.2f} GB/s", ""]
        )
        rows.append(
            [
                "shuffled batches of 4096: our dataset (`open_dataset`)",
                f"{from_ours:.2f} GB/s",
                f"{from_ours / from_saev:.2f}× the saev view",
            ]
        )

        files = sorted(dump_dir.glob("acts*.bin"))
        copy_s = timed(lambda: [copy_synced(f, out / f.name) for f in files])
        for f in files:
            (out / f.name).unlink()
        copy = data_bytes / copy_s / 1e9
        rows.append(["copy the shard files and fsync (`shutil.copyfile`)", f"{copy:.2f} GB/s", ""])
        for workers in (1, 2):
            shutil.rmtree(out / "ds2", ignore_errors=True)
            t = timed(
                lambda w=workers: saev_to_dataset(dump_dir, out / "ds2", workers=w, progress=False)
            )
            rate = data_bytes / t / 1e9
            rows.append(
                [
                    f"saev → safetensors, {workers} worker(s)",
                    f"{rate:.2f} GB/s",
                    f"{rate / copy:.0%} of copy",
                ]
            )
        for workers in (1, 2):
            shutil.rmtree(out / "back", ignore_errors=True)
            t = timed(
                lambda w=workers: dataset_to_saev(ds_dir, out / "back", workers=w, progress=False)
            )
            rate = data_bytes / t / 1e9
            rows.append(
                [
                    f"safetensors → saev, {workers} worker(s)",
                    f"{rate:.2f} GB/s",
                    f"{rate / copy:.0%} of copy",
                ]
            )
    finally:
        shutil.rmtree(out, ignore_errors=True)
    header = (
        f"saev dump: {N_IMGS:,} images x 1 layer x {PATCHES + 1} tokens x {D} float32 "
        f"({data_bytes / 1e9:.2f} GB in {-(-N_IMGS // IMGS_PER_SHARD)} shards), converted to an F32 dataset; page cache warm. "
        "Command: `python -m benchmarks saev`.\n\n"
    )
    return header + table(["case", "result", "vs"], rows)


if __name__ == "__main__":
    print(run())
