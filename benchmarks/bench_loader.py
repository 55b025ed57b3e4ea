"""The torch loader on ≥ 2 GB token-level datasets (F16, H = 384 and 4096), page cache warm.

Shuffled batches of 4096 rows delivered as float32 torch tensors, in GB/s of output,
against, on the same data in the same run:

(a) the machine's sequential read of the same shard files (``np.fromfile``, GB/s read);
(b) a saev-style reader: a map-style dataset over ``np.memmap`` returning one random row
    per ``__getitem__``, batched by a DataLoader (measured on the first batches);
(c) pyarrow parquet → torch: the same activations in a parquet file (float16, one row
    group per 65,536 rows), row groups in shuffled order, rows shuffled within each.

Then random (key, layer) lookups on a KV dataset: p50 / p95 latency of ``ds.get``.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import table

TARGET_BYTES = 2_200_000_000  # a little over 2 GB of F16 per dataset
BATCH = 4096


def make_tokens(root: Path, hidden: int):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pyspark_safetensors.dataset import write_batch_dataset
    from pyspark_safetensors.format import to_f16

    rows = TARGET_BYTES // (2 * hidden)
    rng = np.random.default_rng(hidden)
    acts = to_f16(rng.standard_normal((rows, hidden), dtype=np.float32))
    write_batch_dataset(
        root / "st", {"activation": acts}, rows_per_shard=max(1, (128 << 20) // (2 * hidden))
    )
    values = pa.array(acts.reshape(-1), type=pa.float16())
    column = pa.FixedSizeListArray.from_arrays(values, hidden)
    pq.write_table(
        pa.table({"activation": column}),
        root / "acts.parquet",
        row_group_size=65_536,
        compression="none",
    )
    return rows


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def sequential_read(files: list[Path]) -> tuple[int, float]:
    start, total = time.perf_counter(), 0
    for f in files:
        total += np.fromfile(f, dtype=np.uint8).nbytes
    return total, time.perf_counter() - start


def ours(root: Path, workers: int) -> tuple[int, float]:
    from pyspark_safetensors.torch import ActivationLoader, open_dataset

    loader = ActivationLoader(
        open_dataset(root), BATCH, columns=["activation"], num_workers=workers
    )
    start, total = time.perf_counter(), 0
    for batch in loader:
        total += batch["activation"].numel() * 4
    return total, time.perf_counter() - start


class SaevStyleRows:
    """One row per ``__getitem__`` from per-shard ``np.memmap``s, as saev's reader does."""

    def __init__(self, root: Path):
        from pyspark_safetensors.format import read_header
        from pyspark_safetensors.torch import open_dataset

        ds = open_dataset(root)
        self.starts, self.maps = np.asarray(ds.starts), []
        for path in ds.paths:
            header = read_header(path)
            info = header["activation"]
            self.maps.append(
                np.memmap(
                    path,
                    dtype=np.float16,
                    mode="r",
                    offset=header.data_start + info.begin,
                    shape=info.shape,
                )
            )
        self.length = len(ds)

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        import torch

        shard = int(np.searchsorted(self.starts, i, side="right") - 1)
        return torch.from_numpy(
            np.asarray(self.maps[shard][i - self.starts[shard]], dtype=np.float32)
        )


def saev_style(root: Path, batches: int) -> tuple[int, float]:
    import torch

    loader = torch.utils.data.DataLoader(
        SaevStyleRows(root), batch_size=BATCH, shuffle=True, num_workers=0
    )
    start, total = time.perf_counter(), 0
    for n, batch in enumerate(loader):
        total += batch.numel() * 4
        if n + 1 == batches:
            break
    return total, time.perf_counter() - start


def parquet_to_torch(path: Path, seed: int = 0) -> tuple[int, float]:
    import pyarrow.parquet as pq
    import torch

    rng = np.random.default_rng(seed)
    start, total = time.perf_counter(), 0
    f = pq.ParquetFile(path)
    pending = []
    for group in rng.permutation(f.num_row_groups):
        column = f.read_row_group(int(group), columns=["activation"]).column(0).combine_chunks()
        hidden = column.type.list_size
        rows = column.values.to_numpy().reshape(-1, hidden)[rng.permutation(len(column))]
        pending.append(rows)
        block = np.concatenate(pending)
        for i in range(0, len(block) - BATCH + 1, BATCH):
            total += torch.from_numpy(block[i : i + BATCH]).to(torch.float32).numel() * 4
        pending = [block[len(block) - len(block) % BATCH :]]
    return total, time.perf_counter() - start


def kv_latency(root: Path, samples: int = 400, layers: int = 12, seq: int = 128, hidden: int = 384):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pyspark_safetensors.dataset import (
        INDEX_SCHEMA,
        ColumnSchema,
        Manifest,
        ShardEntry,
        index_rows,
        shard_name,
        write_manifest,
    )
    from pyspark_safetensors.format import to_f16, write_shard
    from pyspark_safetensors.torch import open_dataset

    root.mkdir(parents=True)
    rng = np.random.default_rng(1)
    entries, tables, per_shard = [], [], 100
    for s in range(0, samples, per_shard):
        tensors = {
            f"s{i:05d}__layer{j}": to_f16(rng.standard_normal((seq, hidden), dtype=np.float32))
            for i in range(s, min(s + per_shard, samples))
            for j in range(layers)
        }
        name = shard_name(s // per_shard, 0)
        header = write_shard(root / name, tensors)
        tables.append(pa.table(index_rows(name, header), schema=INDEX_SCHEMA))
        entries.append(ShardEntry(name, min(per_shard, samples - s), header.file_size, s))
    pq.write_table(pa.concat_tables(tables), root / "_tensor_index.parquet")
    schema = {f"layer{j}": ColumnSchema("F16", (seq, hidden), (seq, hidden)) for j in range(layers)}
    write_manifest(
        root,
        Manifest(
            tuple(entries),
            schema,
            mode="kv",
            name_col="key",
            kv_separator="__",
            index_file="_tensor_index.parquet",
        ),
    )
    ds = open_dataset(root)
    keys = ds.keys()
    picks = [
        (keys[i], f"layer{j}")
        for i, j in zip(
            rng.integers(0, len(keys), 20_000), rng.integers(0, layers, 20_000), strict=True
        )
    ]
    for key, layer in picks[:2000]:  # warm: index loaded, files mapped, pages cached
        ds.get(key, layer)
    times = np.empty(len(picks))
    for n, (key, layer) in enumerate(picks):
        t = time.perf_counter_ns()
        ds.get(key, layer)
        times[n] = time.perf_counter_ns() - t
    return (
        np.percentile(times, 50) / 1e3,
        np.percentile(times, 95) / 1e3,
        samples * layers * seq * hidden * 2,
    )


def run() -> str:
    out = Path(tempfile.mkdtemp(prefix="bench-loader-"))
    rows_out = []
    try:
        for hidden in (384, 4096):
            root = out / f"h{hidden}"
            rows = make_tokens(root, hidden)
            files = sorted((root / "st").glob("*.safetensors"))
            size = sum(f.stat().st_size for f in files)
            sequential_read(files)  # warm the page cache
            parquet_to_torch(root / "acts.parquet")
            read, seconds = sequential_read(files)
            seq = gbps(read, seconds)
            results = {"(a) np.fromfile, sequential (GB/s read)": seq}
            for workers in (0, 2):
                results[f"ours, shuffled, {workers} DataLoader workers"] = gbps(
                    *ours(root / "st", workers)
                )
            results["(b) saev-style memmap rows + DataLoader"] = gbps(*saev_style(root / "st", 8))
            results["(c) pyarrow parquet → torch, row-group shuffle"] = gbps(
                *parquet_to_torch(root / "acts.parquet")
            )
            best = max(v for k, v in results.items() if k.startswith("ours"))
            for name, value in results.items():
                ratio = "" if name.startswith("(a)") else f"{value / seq:.0%} of (a)"
                if name.startswith("(b)") or name.startswith("(c)"):
                    ratio += f"; ours is {best / value:.1f}×"
                rows_out.append(
                    [f"H={hidden}, {rows:,} rows, {size / 1e9:.2f} GB", name, f"{value:.2f}", ratio]
                )
                print(rows_out[-1], flush=True)
            shutil.rmtree(root)
        p50, p95, kv_bytes = kv_latency(out / "kv")
        print(p50, p95, flush=True)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    body = table(["dataset (F16)", "reader", "GB/s (float32 out)", "vs"], rows_out)
    body += (
        f"\n\nKV lookups (`ds.get(key, layer)`, one `[128, 384]` F16 tensor, {kv_bytes / 1e6:.0f} MB dataset, "
        f"20,000 random lookups, warm): p50 {p50:.1f} µs, p95 {p95:.1f} µs."
    )
    return body


if __name__ == "__main__":
    print(run())
