"""The feature job (every token encoded by an SAE inside Spark, per-latent statistics and
top-N merged by Spark) against a single-process loop over the same dataset with the same
state and tables (``features.reference``), the whole job each, at two sizes: a real
extraction, and the same activations tiled with small noise to over a million tokens
(extracting that many on two cores takes too long). The contexts of both must agree."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from pyspark_safetensors.extract import ExtractConfig, run_extraction
from pyspark_safetensors.features import FeaturesConfig, plan_features, run_features
from pyspark_safetensors.features.job import CONTEXTS_FILE, LATENTS_FILE, parquet_bytes
from pyspark_safetensors.features.merge import latents_table
from pyspark_safetensors.features.page import browser_files
from pyspark_safetensors.features.reference import reference_contexts, reference_state
from pyspark_safetensors.sae import save_sae
from pyspark_safetensors.spark.session import local_session
from pyspark_safetensors.spark.tensor_struct import TENSOR_STRUCT_DDL, tensor_structs_of_rows

from .common import table, worker_peak_rss

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
    # one copy after the other, each in the dataset's order: the tiled rows stay in token
    # order, as an extraction writes them
    tiled = functools.reduce(DataFrame.union, (
        tokens.withColumn("copy", F.lit(c).cast("long")).mapInArrow(
            _noisy_copies(WIDTH, samples),
            f"activation {TENSOR_STRUCT_DDL}, sample_id long, token_pos int, window int",
        ) for c in range(copies)
    ))  # fmt: skip
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


def _loop_job(config: FeaturesConfig, out: Path) -> tuple[float, float, object, pa.Table]:
    """The whole job as one process would run it: plan, the state pass, the contexts,
    the tables, the browser, the files. Returns the state pass's seconds, the whole
    job's, the state and the contexts table."""
    start = time.perf_counter()
    plan = plan_features(config)
    state = reference_state(plan, config)
    state_s = time.perf_counter() - start
    contexts = reference_contexts(plan, config, state)
    latents = latents_table(state, config)
    files = {LATENTS_FILE: parquet_bytes(latents), CONTEXTS_FILE: parquet_bytes(contexts)}
    files |= browser_files(latents, contexts, title=plan.hook, tokens=state.tokens, config=config)
    for name, data in files.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(data)
    return state_s, time.perf_counter() - start, state, contexts


def _same_contexts(got: pa.Table, want: pa.Table) -> bool:
    keys = ["latent", "kind", "rank", "sample_id", "window", "token_pos", "center", "tokens"]
    if not got.select(keys).equals(want.select(keys)):
        return False
    a = got.column("acts").combine_chunks().flatten().to_numpy()
    b = want.column("acts").combine_chunks().flatten().to_numpy()
    return bool(np.allclose(a, b, rtol=1e-5, atol=1e-6))


def _measure(spark, extraction: Path, sae: Path, out: Path) -> list:
    config = FeaturesConfig(extraction=str(extraction), sae=str(sae), out=str(out), top_n=TOP_N,
                            threads=1, overwrite=True)  # fmt: skip
    start = time.perf_counter()
    summary = run_features(spark, config)
    job_s = time.perf_counter() - start
    rss = worker_peak_rss(spark)
    reference_state(plan_features(config), config)  # warm: the SAE loaded, pages cached
    loop = {}  # (state pass, whole job) seconds by torch threads
    for threads in (1, 2):
        loop_out = out.with_name(f"{out.name}-loop-{threads}")
        loop_out.mkdir()
        *loop[threads], state, contexts = _loop_job(
            dataclasses.replace(config, threads=threads, out=str(loop_out)), loop_out
        )
        shutil.rmtree(loop_out)
    state_s = min(s for s, _ in loop.values())  # the faster single process, as a user runs it
    whole_s = min(w for _, w in loop.values())
    if not _same_contexts(pq.read_table(out / "contexts.parquet"), contexts):
        raise AssertionError(f"{extraction}: the Spark job's contexts differ from the loop's")
    state_mb = sum(t.numel() * t.element_size() for t in
                   [state.counts, state.sums, state.maxima, *state.top.values(),
                    *state.samples.values()]) / 1e6  # fmt: skip
    n = summary.tokens
    return [
        f"{n:,}", f"{summary.tokens_per_s:,.0f}", f"{n / job_s:,.0f}",
        " / ".join(f"{n / loop[t][0]:,.0f}" for t in (1, 2)),
        " / ".join(f"{n / loop[t][1]:,.0f}" for t in (1, 2)),
        f"{summary.tokens_per_s * state_s / n:.2f}x", f"{whole_s / job_s:.2f}x",
        f"{rss:,.0f} MB", f"{state_mb:.1f} MB", "equal",
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
        "latent, contexts of ±8 tokens. Spark: `local[2]`, one torch thread per task, "
        "`run_features` timed from call to return (files written); loop: one process "
        "(`features.reference`), the faster of one and two torch threads: the same state "
        "pass over the dataset's shards (each candidate's window kept from its chunk), then "
        "the example texts tokenized, the two tables, the browser and the files. The "
        f"smaller dataset is a real extraction of {TEXTS} passages; the larger is it tiled "
        "with new sample ids and N(0, 0.02) noise (extracting a million tokens on 2 cores "
        "takes too long). Encode+merge: the statistics, top-N and windows pass; whole job: "
        "everything. Contexts compared with the loop's (tokens, positions, activations). "
        "One run.\n\n"
        + table(
            [
                "tokens",
                "Spark encode+merge tok/s",
                "Spark whole job tok/s",
                "loop state pass tok/s, 1 / 2 threads",
                "loop whole job tok/s, 1 / 2 threads",
                "encode+merge / faster loop",
                "whole job / faster loop",
                "peak RSS per Python worker",
                "state per task",
                "contexts vs loop",
            ],
            rows,
        )
    )
