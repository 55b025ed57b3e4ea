"""Header reading: a 200,000-tensor KV shard's header, ours against the reference library's
``safe_open`` in the same run."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np
from safetensors import safe_open

from benchmarks.common import interleaved_medians, table
from pyspark_safetensors.format import PackedTensors, get_dtype, read_header, write_packed
from pyspark_safetensors.format.shard import read_header_length

N_TENSORS = 200_000
REPEAT = 7
FINDINGS = """

Command: `python -m benchmarks header`. Both readers do the whole job here: the reference parses and validates in Rust; ours returns
a validated `Header` with one `TensorInfo` per tensor. We stay behind by 1.2-1.4× (3.6× with
the general parser alone before; runs on this 2-core machine vary by about ±0.1): about a third of our time is splitting
the 18 MB of text at its quotes and two regular-expression passes over the offsets and
names, and most of the rest is building 200,000 Python tuples, their name lookup and the
one garbage-collector pass over them, which Rust does not pay. The general parser (any
JSON layout: whitespace, escapes, unknown fields) is ~5× the reference: Python's json
module, then one Python validation per entry; it only runs on headers the bulk parser
does not recognise, and produces every error."""


def _kv_shard(path: Path, varying: bool) -> None:
    """One tensor per sample, named like the KV writer names them: F16 [seq_len, 8], with
    one seq_len for all or 64 different ones."""
    rng = np.random.default_rng(0)
    seq = rng.integers(1, 65, N_TENSORS) if varying else np.full(N_TENSORS, 16)
    f16 = get_dtype("F16")
    specs = tuple((f16, (int(s), 8)) for s in range(65))
    sizes = seq * 8 * 2
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    data = np.zeros(int(sizes.sum()), np.uint8)
    names = [f"doc-{i:07d}__activation" for i in range(N_TENSORS)]
    write_packed(
        path,
        [(names, PackedTensors(data, starts, specs, seq.astype(np.int64)))],
        {"format": "pt"},
        fsync=False,
    )


def _reference(path: Path):
    with safe_open(str(path), framework="numpy") as f:
        return f.keys()


def _general(path: Path):
    from pyspark_safetensors.format import decode_header

    with open(path, "rb") as f:
        size = f.seek(0, 2)
        f.seek(0)
        prefix = f.read(8)
        body = f.read(read_header_length(prefix, size))
    return decode_header(prefix + body, size, str(path), fast=False)


def run() -> str:
    out = Path(tempfile.mkdtemp(prefix="bench-header-"))
    rows = []
    try:
        for varying in (False, True):
            path = out / f"kv-{varying}.safetensors"
            _kv_shard(path, varying)
            header_mb = read_header(path).data_start / 1e6
            seconds = interleaved_medians(
                {
                    "reference `safe_open` + `keys()`": lambda p=path: _reference(p),
                    "ours `read_header`": lambda p=path: read_header(p),
                    "ours, general parser only (the twin)": lambda p=path: _general(p),
                },
                repeat=REPEAT,
            )
            base = seconds["reference `safe_open` + `keys()`"]
            shapes = "64 shapes" if varying else "one shape"
            rows += [
                [f"{shapes}, {header_mb:.1f} MB header", name, f"{s * 1e3:.0f}", f"{s / base:.2f}x"]
                for name, s in seconds.items()
            ]
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return (
        "## Header reading: a 200,000-tensor KV shard\n\n"
        f"{N_TENSORS:,} F16 tensors `[seq_len, 8]` named `doc-NNNNNNN__activation`, warm page "
        f"cache, interleaved runs, median of {REPEAT}; ratio = time / reference time (lower is "
        "better). `read_header` validates every rule and returns every entry as a "
        "`TensorInfo`; the reference's `keys()` lists the names.\n\n"
        + table(["file", "reader", "ms", "vs reference"], rows)
        + FINDINGS
    )
