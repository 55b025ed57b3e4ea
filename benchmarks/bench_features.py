"""The feature job (every token encoded by an SAE inside Spark, per-latent statistics and
top-N merged by Spark) against a single-process loop over the same dataset with the same
state (``features.reference_state``), at two sizes: a real extraction, and the same
activations tiled with small noise to over a million tokens (extracting that many on two
cores takes too long). The top-N lists of both must be identical."""

from __future__ import annotations

import dataclasses
import json
import math
import resource
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from pyspark_safetensors.extract import ExtractConfig, run_extraction
from pyspark_safetensors.features import FeaturesConfig, plan_features, run_features
from pyspark_safetensors.features.merge import examples_table
from pyspark_safetensors.features.reference import reference_state
from pyspark_safetensors.sae import save_sae
from pyspark_safetensors.spark.session import local_session
from pyspark_safetensors.spark.tensor_struct import TENSOR_STRUCT_DDL, tensor_structs_of_rows

from .common import table

HOOK, WIDTH, LATENTS, K = "encoder.layer.0:output", 384, 3072, 32
TEXTS, LARGE_TOKENS, TOP_N = 200, 1_000_000, 20


def _sae(path: Path) -> Path:
    gen = torch.Generator().manual_seed(0)
    dec = torch.randn(LATENTS, WIDTH, generator=gen)
    dec /= dec.norm(dim=1, keepdim=True)
    save_sae(path, {"encoder_weight": dec.clone(), "encoder_bias": torch.zeros(LATENTS),
                    "decoder_weight": dec, "decoder_bias": torch.zeros(WIDTH)},
             {"k": str(K), "hook_point": HOOK})  # fmt: skip
    return path


def _noisy_copies(width: int, samples: int):
    def run(batches):
        for b in batches:
            copy = b.column("copy").to_numpy()
            x = b.column("activation").flatten().to_numpy().reshape(len(b), width)
            noise = np.random.default_rng(int(copy[0]) if len(b) else 0).normal(0, 0.02, x.shape)
            yield pa.RecordBatch.from_pydict({
                "activation": tensor_structs_of_rows((x + noise).astype(np.float16), "F16"),
                "sample_id": pa.array(b.column("sample_id").to_numpy() + copy * samples),
                "token_pos": b.column("token_pos"),
                "window": b.column("window"),
            })  # fmt: skip

    return run


def _tile(spark, small: Path, big: Path, copies: int) -> None:
    """``small`` repeated ``copies`` times (new sample ids, noisy activations): an
    extraction of the same shape, texts and tables tiled alike."""
    doc = json.loads((small / "extraction.json").read_text())
    dataset = doc["hooks"][HOOK]["dataset"]
    info = pq.read_table(small / "samples.parquet")
    samples = int(info.column("sample_id").to_numpy().max()) + 1
    tokens = spark.read.format("safetensors").load(str(small / dataset))
    tiled = tokens.crossJoin(spark.range(copies).withColumnRenamed("id", "copy")).mapInArrow(
        _noisy_copies(WIDTH, samples),
        f"activation {TENSOR_STRUCT_DDL}, sample_id long, token_pos int, window int",
    )
    tiled.write.format("safetensors").option("batch_size", 16384).mode("overwrite").save(
        str(big / dataset)
    )
    pq.write_table(pa.concat_tables(
        info.set_column(0, "sample_id", pa.array(info.column("sample_id").to_numpy() + c * samples))
        for c in range(copies)
    ), big / "samples.parquet")  # fmt: skip
    lines = (small / "texts.jsonl").read_text().splitlines()
    with open(big / "texts.jsonl", "w") as f:
        for c in range(copies):
            for line in lines:
                row = json.loads(line)
                f.write(json.dumps({**row, "sample_id": row["sample_id"] + c * samples}) + "\n")
    (big / "extraction.json").write_text(json.dumps(doc))


def _worker_peak_rss(spark) -> float:
    """The largest peak resident memory of the Python workers (reused between tasks, so
    the peak of the largest task they ran), in MB."""

    def peak(batches):
        for _ in batches:
            pass
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        yield pa.RecordBatch.from_pydict({"mb": pa.array([rss])})

    rows = spark.range(0, 8, numPartitions=8).mapInArrow(peak, "mb double").collect()
    return max(r.mb for r in rows)


def _measure(spark, extraction: Path, sae: Path, out: Path) -> list:
    config = FeaturesConfig(extraction=str(extraction), sae=str(sae), out=str(out), top_n=TOP_N,
                            threads=1, overwrite=True)  # fmt: skip
    summary = run_features(spark, config)
    rss = _worker_peak_rss(spark)
    loop = {}  # seconds by torch threads; the SAE is loaded once, before either is timed
    reference_state(plan_features(config), config)  # warm: the SAE loaded, pages cached
    for threads in (1, 2):
        start = time.perf_counter()
        state = reference_state(plan_features(config), dataclasses.replace(config, threads=threads))
        loop[threads] = time.perf_counter() - start
    loop_s = min(loop.values())  # the faster single process, as a user would run it
    keys = ["latent", "kind", "rank", "value", "sample_id", "window", "token_pos"]
    want = examples_table(state, config).to_pandas()[keys].sort_values(keys[:3])
    got = pq.read_table(out / "contexts.parquet").to_pandas()[keys].sort_values(keys[:3])
    same = got.reset_index(drop=True).equals(want.reset_index(drop=True))
    if not same:
        raise AssertionError(f"{extraction}: the Spark job's top-N differ from the loop's")
    state_mb = sum(t.numel() * t.element_size() for t in
                   [state.counts, state.sums, state.maxima, *state.top.values(),
                    *state.samples.values()]) / 1e6  # fmt: skip
    return [
        f"{summary.tokens:,}", f"{summary.tokens_per_s:,.0f}",
        f"{summary.tokens / summary.seconds:,.0f}",
        " / ".join(f"{summary.tokens / loop[t]:,.0f}" for t in (1, 2)),
        f"{summary.tokens_per_s * loop_s / summary.tokens:.2f}x", f"{rss:,.0f} MB",
        f"{state_mb:.1f} MB", "identical",
    ]  # fmt: skip


def run() -> str:
    spark = local_session("local[2]", **{"spark.ui.showConsoleProgress": "false"})
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        sae = _sae(tmp / "sae.safetensors")
        config = ExtractConfig(hooks=(HOOK,), max_texts=TEXTS, max_length=128)
        small = run_extraction(spark, config, tmp / "small").out_dir
        rows.append(_measure(spark, Path(small), sae, tmp / "features-small"))
        print(rows[-1], flush=True)
        tokens = int(json.loads((Path(small) / "extraction.json").read_text())["summary"]["tokens"])
        big = tmp / "large"
        big.mkdir()
        _tile(spark, Path(small), big, math.ceil(LARGE_TOKENS / tokens))
        shutil.rmtree(tmp / "features-small")
        rows.append(_measure(spark, big, sae, tmp / "features-large"))
    spark.stop()
    return (
        f"SAE {WIDTH} → {LATENTS} latents, TopK k={K}, on `{HOOK}` (F16); top-{TOP_N} per "
        "latent. Spark: `local[2]`, one torch thread per task; loop: one process, the faster "
        "of one and two torch threads, the same state updates over the dataset's shards "
        "(torch reader). The "
        f"smaller dataset is a real extraction of {TEXTS} passages; the larger is it tiled "
        "with new sample ids and N(0, 0.02) noise (extracting a million tokens on 2 cores "
        "takes too long). Encode+merge: the statistics and top-N pass (what the loop does); "
        "whole job adds the contexts pass, the parquet writes and the browser. One run.\n\n"
        + table(
            [
                "tokens",
                "Spark encode+merge tok/s",
                "Spark whole job tok/s",
                "loop tok/s, 1 / 2 threads",
                "Spark / faster loop",
                "peak RSS per Python worker",
                "state per task",
                "top-N vs loop",
            ],
            rows,
        )
    )
