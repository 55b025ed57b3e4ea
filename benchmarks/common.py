"""Timing helpers shared by the benchmarks."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_seconds(fn: Callable[[], object], repeat: int = 5, warmup: int = 1) -> float:
    """Median wall time of ``fn`` over ``repeat`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def interleaved_medians(
    cases: dict[str, Callable[[], object]],
    repeat: int = 5,
    warmup: int = 1,
    settle: Callable[[], object] | None = None,
) -> dict[str, float]:
    """Median wall time of each case, running the cases in turn ``repeat`` times, so
    slow drifts of a shared machine touch every case alike. ``settle`` runs untimed
    before each run (e.g. ``os.sync``, so no case pays for the previous one's writes)."""
    for fn in cases.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeat):
        for name, fn in cases.items():
            if settle is not None:
                settle()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def table(header: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def clt_layers(
    root,
    *,
    layers: int,
    width: int,
    atoms: int,
    active: int,
    tokens: int,
    val_tokens: int,
    sigma: float = 1.0,
    seed: int = 0,
    rows_per_shard: int = 65536,
) -> dict[str, list[str]]:
    """Synthetic MLP-like activations of ``layers`` layers for cross-layer transcoders, as
    row-aligned token datasets under ``root``: returns their paths (``train_x``,
    ``train_y``, ``val_x``, ``val_y``: a path per layer each). Layer l's input is its own
    sparse code (``active`` of ``atoms`` atoms per token, log-normal magnitudes of log-sd
    ``sigma``) through a random unit-norm dictionary of ``width``, plus a large per-layer
    mean (an MLP's input carries the residual stream's) and noise 0.05; layer t's output is
    written by the codes of every layer at or below it, ``sum_{l <= t} w_{l,t} code_l
    A_{l,t}`` with ``w = 1`` for the layer's own code and 0.5 for an earlier layer's, plus
    noise 0.05: the part a per-layer transcoder cannot see in its input and a CLT can.
    Held-out rows are ``val_tokens`` other draws."""
    from pathlib import Path

    import numpy as np

    from pyspark_safetensors.dataset import write_batch_dataset

    rng = np.random.default_rng(seed)

    def unit(*shape):
        m = rng.standard_normal((*shape, width)).astype(np.float32)
        return m / np.linalg.norm(m, axis=-1, keepdims=True)

    a_in, a_out = unit(layers, atoms), unit(layers, layers, atoms)
    means = 4 * rng.standard_normal((layers, width)).astype(np.float32)
    paths: dict[str, list[str]] = {}
    for split, n in (("val", val_tokens), ("train", tokens)):
        codes = []
        for _ in range(layers):
            code = np.zeros((n, atoms), np.float32)
            cols = np.argsort(rng.random((n, atoms)), axis=1)[:, :active]
            np.put_along_axis(code, cols, rng.lognormal(0.0, sigma, (n, active)), axis=1)
            codes.append(code)
        ids = {"sample_id": np.arange(n, dtype=np.int64) // 128,
               "token_pos": (np.arange(n) % 128).astype(np.int32)}  # fmt: skip
        for t in range(layers):
            x = codes[t] @ a_in[t] + means[t] + 0.05 * rng.standard_normal((n, width))
            y = sum((1.0 if s == t else 0.5) * codes[s] @ a_out[s, t] for s in range(t + 1))
            y = y + 0.05 * rng.standard_normal((n, width))
            for side, a, hook in (("x", x, "input"), ("y", y, "output")):
                out = Path(root) / f"{split}_{side}{t}"
                write_batch_dataset(out, {"activation": a.astype(np.float32), **ids},
                                    rows_per_shard=rows_per_shard,
                                    metadata={"hook_point": f"model.layers.{t}.mlp:{hook}"})  # fmt: skip
                paths.setdefault(f"{split}_{side}", []).append(str(out))
    return paths


def worker_peak_rss(spark) -> float:
    """The largest peak resident memory of a Spark session's Python workers, in MB.
    Workers are reused between tasks, so it is the peak of the largest task they ran."""
    import resource

    import pyarrow as pa

    def peak(batches):
        for _ in batches:
            pass
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        yield pa.RecordBatch.from_pydict({"mb": pa.array([rss])})

    rows = spark.range(0, 8, numPartitions=8).mapInArrow(peak, "mb double").collect()
    return max(r.mb for r in rows)
