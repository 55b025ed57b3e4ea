"""Extraction throughput: the Spark job (model inside mapInArrow, datasets written) against
the same model in a plain Python loop (same batch size, nothing written)."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from pyspark_safetensors.extract import (
    ExtractConfig,
    Extractor,
    default_model_dir,
    passages_by_key,
    run_extraction,
)
from pyspark_safetensors.spark.session import local_session

from .common import table

TEXTS = 400


def run() -> str:
    config = ExtractConfig(max_texts=TEXTS, max_length=128, batch_size=32)
    sample = passages_by_key(0, TEXTS)  # the texts the job picks: the first by key
    extractor = Extractor(default_model_dir(), list(config.hooks), max_length=128, batch_size=32)
    start = time.perf_counter()
    windows = extractor.run(sample)
    loop_s = time.perf_counter() - start
    loop_tokens = sum(w.seq_len for w in windows)

    spark = local_session("local[2]", **{"spark.ui.showConsoleProgress": "false"})
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        summary = run_extraction(spark, config, Path(tmp) / "out")
        job_s = time.perf_counter() - start
    spark.stop()
    rows = [
        ["plain Python loop (1 process, all cores)", f"{loop_tokens:,}", f"{loop_s:.1f} s",
         f"{loop_tokens / loop_s:,.0f}"],
        ["Spark job, model stage only (local[2])", f"{summary.tokens:,}", f"{summary.seconds:.1f} s",
         f"{summary.tokens_per_s:,.0f}"],
        ["Spark job, end to end (+ datasets, KV, metadata)", f"{summary.tokens:,}", f"{job_s:.1f} s",
         f"{summary.tokens / job_s:,.0f}"],
    ]  # fmt: skip
    return (
        f"MiniLM-L6 (2 hook points, F16), {TEXTS} demo passages, max_length 128, batch 32.\n\n"
        + table(["run", "tokens", "time", "tokens/s"], rows)
    )
