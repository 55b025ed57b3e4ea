"""Cast throughput: our float32 -> float16/bfloat16 against torch's and numpy's, same run."""

from __future__ import annotations

import numpy as np
import torch

from benchmarks.common import median_seconds, table
from pyspark_safetensors.format import casts

N = 64 << 20  # float32 elements: 256 MiB in


def run() -> str:
    x = np.random.default_rng(0).standard_normal(N).astype(np.float32)
    tx = torch.from_numpy(x)
    gb = x.nbytes / 1e9
    cases = [
        ("F16", "ours (C kernel, F16C, threads)", lambda: casts.to_f16(x)),
        ("F16", "torch `.to(float16)`", lambda: tx.to(torch.float16)),
        ("F16", "numpy `astype(float16)`", lambda: x.astype(np.float16)),
        ("F16", "ours, numpy twin (reference)", lambda: casts.reference_f16(x)),
        ("BF16", "ours (C kernel, threads)", lambda: casts.to_bf16(x)),
        ("BF16", "torch `.to(bfloat16)`", lambda: tx.to(torch.bfloat16)),
        ("BF16", "ours, numpy twin (reference)", lambda: casts.reference_bf16(x)),
    ]
    rows = []
    for target, name, fn in cases:
        s = median_seconds(fn, repeat=5)
        rows.append([target, name, f"{gb / s:.2f}"])
    return (
        "## Casts: float32 → float16 / bfloat16\n\n"
        f"{N:,} float32 values (256 MiB in), median of 5, GB/s of input. "
        f"torch uses {torch.get_num_threads()} threads; ours splits large arrays over all cores.\n\n"
        + table(["target", "implementation", "GB/s"], rows)
    )
