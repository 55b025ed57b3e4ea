"""Zarr activation stores: the layout's validation criteria, measured.

One store of N samples x L layers, T_max x H float16 (seq_len uniform in [T_max/8,
T_max], so one (sample, layer) is one chunk file), written by our ``StoreWriter``; the
same data converted to our KV safetensors dataset; page cache warm. Measured in the same
run:

- 10,000 random ``(i, random layer)`` queries, each returning ``[seq_len, H]``: read
  time per query (mean / p50 / p95, timed inside the process doing the read) and queries
  per second, with 0, 2 and 4 DataLoader workers (``spawn``), for our reader's direct
  chunk-file path, zarr-python's own path (``zarr.open_group(mode="r")`` on the
  consolidated store, ``arr[i, l, :n, :]``) and our KV dataset (``get(key, column)``);
- write throughput (GB of activations per second) of W = 1 and 2 writer processes,
  each writing its own shard of a run with ``StoreWriter`` (the run's manifest last),
  and of one writer through zarr-python's own writes (``direct=False``);
- the Spark extraction writing its samples as a Zarr run with 1 and 2 tasks.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import table

N, L, T_MAX, H = int(os.environ.get("BENCH_ZARR_N", 600)), 8, 256, 768
QUERIES = int(os.environ.get("BENCH_ZARR_QUERIES", 10_000))
WRITE_SAMPLES = 240


def sample(rng, i: int) -> np.ndarray:
    n = int(rng.integers(T_MAX // 8, T_MAX + 1))
    return rng.standard_normal((L, n, H), dtype=np.float32).astype(np.float16)


def make_store(path: Path) -> None:
    from pyspark_safetensors.interop.zarr import StoreWriter

    rng = np.random.default_rng(0)
    with StoreWriter(path, num_layers=L, hidden_size=H, t_max=T_MAX, model_id="bench",
                     num_samples=N) as w:  # fmt: skip
        for i in range(N):
            w.add(sample(rng, i), sample_key=f"{i:064x}")


class Queries:
    """A map-style dataset: item k = query k, returning (seconds of the read, bytes)."""

    def __init__(self, kind: str, path: str, queries: np.ndarray):
        self.kind, self.path, self.queries = kind, path, queries
        self.reader = None

    def __len__(self) -> int:
        return len(self.queries)

    def _open(self):
        if self.kind == "ours":
            from pyspark_safetensors.interop.zarr import ActivationStore

            store = ActivationStore(self.path)
            assert store.fast
            return store.read
        if self.kind == "zarr-python":
            import zarr

            group = zarr.open_group(self.path, mode="r")
            acts, seq = group["arrays/activations"], group["arrays/seq_len"][:]
            return lambda i, layer: acts[i, layer, : seq[i], :]
        from pyspark_safetensors.torch import open_dataset

        ds = open_dataset(self.path)
        ds.keys()  # the key index, once per process
        return lambda i, layer: ds.get(f"{i:064x}", f"layer_{layer}")

    def __getitem__(self, k: int):
        if self.reader is None:
            self.reader = self._open()
        i, layer = self.queries[k]
        start = time.perf_counter()
        x = self.reader(int(i), int(layer))
        return time.perf_counter() - start, x.nbytes


def run_queries(kind: str, path: Path, queries: np.ndarray, workers: int) -> list:
    import torch

    loader = torch.utils.data.DataLoader(
        Queries(kind, str(path), queries), batch_size=None, num_workers=workers,
        multiprocessing_context="spawn" if workers else None, prefetch_factor=8 if workers else None,
    )  # fmt: skip
    it = iter(loader)
    first = next(it)  # workers started and readers opened: not part of the timing
    start = time.perf_counter()
    times, nbytes = [float(first[0])], int(first[1])
    for t, b in it:
        times.append(float(t))
        nbytes += int(b)
    wall = time.perf_counter() - start
    us = np.array(times) * 1e6
    return [
        f"{us.mean():.0f}",
        f"{np.median(us):.0f}",
        f"{np.percentile(us, 95):.0f}",
        f"{(len(times) - 1) / wall:,.0f}",
    ]


def write_shard(ready, go, path: str, seed: int, count: int, direct: bool = True) -> None:
    """One writer process: its samples generated first (then ``ready``), written once
    ``go`` is set."""
    from pyspark_safetensors.interop.zarr import StoreWriter

    rng = np.random.default_rng(seed)
    data = [sample(rng, i) for i in range(count)]
    ready.wait()
    go.wait()
    with StoreWriter(path, num_layers=L, hidden_size=H, t_max=T_MAX, direct=direct) as w:
        for x in data:
            w.add(x)


def write_run(run_dir: Path, writers: int, direct: bool = True) -> tuple[float, int]:
    """Seconds for ``writers`` processes to write WRITE_SAMPLES samples as a run."""
    from pyspark_safetensors.interop.zarr import ActivationStore, shard_path, write_run_manifest

    ctx = mp.get_context("spawn")
    ready, go = ctx.Barrier(writers + 1), ctx.Event()
    per = WRITE_SAMPLES // writers
    procs = [
        ctx.Process(
            target=write_shard, args=(ready, go, str(run_dir / shard_path(w)), w, per, direct)
        )
        for w in range(writers)
    ]
    for p in procs:
        p.start()
    ready.wait()  # every writer has imported and generated its data
    os.sync()  # no run pays for the previous one's dirty pages
    start = time.perf_counter()
    go.set()
    for p in procs:
        p.join()
        assert p.exitcode == 0
    write_run_manifest(run_dir, [(w, j) for w in range(writers) for j in range(per)])
    seconds = time.perf_counter() - start
    total = sum(int(ActivationStore(run_dir / shard_path(w)).seq_len.sum()) for w in range(writers))
    return seconds, total * L * H * 2


EXTRACT_TEXTS = 160


def extraction(tmp: Path) -> str:
    """The extraction job writing a Zarr run with 1 and 2 Spark tasks."""
    from pyspark_safetensors.extract import ExtractConfig, run_extraction
    from pyspark_safetensors.spark.session import local_session

    spark = local_session("local[2]", **{"spark.ui.showConsoleProgress": "false"})
    rows = []
    try:
        for tasks in (1, 2):
            config = ExtractConfig(max_texts=EXTRACT_TEXTS, partitions=tasks, zarr_run=True,
                                   kv_dataset=False)  # fmt: skip
            start = time.perf_counter()
            summary = run_extraction(spark, config, tmp / f"extract-{tasks}")
            seconds = time.perf_counter() - start
            rows.append([tasks, f"{seconds:.1f}", f"{summary.tokens / seconds:,.0f}"])
    finally:
        spark.stop()
    base = float(rows[0][1])
    for row in rows:
        row.append(f"{base / float(row[1]):.2f}x")
    return table(["Spark tasks (= Zarr writers)", "seconds", "tokens/s", "vs 1 task"], rows)


def run() -> str:
    from pyspark_safetensors.interop import convert

    tmp = Path(tempfile.mkdtemp(prefix="bench-zarr-", dir=os.environ.get("BENCH_DIR")))
    try:
        store = tmp / "acts.zarr"
        make_store(store)
        kv = convert(store, tmp / "kv", to="safetensors", progress=False)
        gb = sum(p.stat().st_size for p in store.rglob("*") if p.is_file()) / 1e9
        rng = np.random.default_rng(1)
        queries = np.stack([rng.integers(0, N, QUERIES), rng.integers(0, L, QUERIES)], axis=1)
        for p in [*store.rglob("*"), *kv.rglob("*")]:  # warm the page cache
            if p.is_file():
                p.read_bytes()
        rows = []
        paths = {"ours (direct chunk files)": ("ours", store),
                 "zarr-python": ("zarr-python", store),
                 "our KV safetensors dataset": ("kv", kv)}  # fmt: skip
        results = {}
        for workers in (0, 2, 4):
            for label, (kind, path) in paths.items():
                results[label, workers] = run_queries(kind, path, queries, workers)
                rows.append([label, workers, *results[label, workers]])
        ratio = {
            w: float(results["zarr-python", w][1])
            / float(results["ours (direct chunk files)", w][1])
            for w in (0, 2, 4)
        }
        read_table = table(
            ["reader", "DataLoader workers", "mean µs", "p50 µs", "p95 µs", "queries/s"], rows
        )
        writes = []
        cases = [(1, True), (2, True), (1, False), (2, False)] * 2  # in turn; the better of 2
        for writers, direct in cases:
            run_dir = tmp / f"run-{len(writes)}"
            writes.append(((writers, direct), *write_run(run_dir, writers, direct)))
            shutil.rmtree(run_dir)
        best = {c: max(b / s for cc, s, b in writes if cc == c) / 1e9 for c in cases[:4]}
        write_table = table(
            ["writer", "W = 1, GB/s", "W = 2, GB/s", "W = 2 / W = 1"],
            [[label, f"{best[1, d]:.2f}", f"{best[2, d]:.2f}", f"{best[2, d] / best[1, d]:.2f}x"]
             for label, d in (("direct chunk files (default)", True),
                              ("zarr-python writes (direct=False)", False))],
        )  # fmt: skip
        spark_table = extraction(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return (
        f"Store: {N} samples x {L} layers x T_max {T_MAX} x H {H} float16 ({gb:.2f} GB, "
        f"chunks (1, 1, {T_MAX}, {H}), one chunk file per (sample, layer)); {QUERIES:,} random "
        "(sample, layer) queries, page cache warm, read time per query measured where it "
        "runs.\n\n"
        + read_table
        + "\n\nzarr-python p50 / ours p50: "
        + ", ".join(f"{ratio[w]:.1f}x with {w} workers" for w in (0, 2, 4))
        + f".\n\nWrites ({WRITE_SAMPLES} samples, each writer its own shard, manifest last, "
        "to the page cache):\n\n"
        + write_table
        + f"\n\nSpark extraction (MiniLM, {EXTRACT_TEXTS} demo passages, 2 hook points, "
        "local[2], samples written as a Zarr run only), whole job:\n\n" + spark_table
    )


if __name__ == "__main__":
    print(run())
