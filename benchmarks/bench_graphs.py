"""Attribution graphs of many 32-token prompts: the Spark job (``graphs.job.run_graphs``,
local session, one task per core, one torch thread each, the model and transcoders
loaded once per Python worker, everything written: parquet, the adjacency dataset, the
browser) at two prompt counts, each in a fresh session, with each Python worker's peak
resident memory; against a loop over prompts in one process (the model loaded once, the
same graph, pruning and scores per prompt, nothing written) at 1 and 2 torch threads.

    python -m benchmarks graphs
    GRAPHS_PROMPTS=100,400 GRAPHS_LOOP=100 python -m benchmarks graphs
    GRAPHS_PROMPTS=1000,10000 GRAPHS_MAX_FEATURES=256 python -m benchmarks graphs

The model and CLT are a CLT demo run's (``./dev demo --config conf/pipeline-clt.toml``:
4 layers, hidden 64, 256 latents a layer, top-k) where there is one; else the package's
tiny toy Llama (``extract.toy_lm``'s ``TINY``: 2 layers, hidden 32, trained here once and
cached under the temporary directory) and a CLT of ``N_LATENTS`` latents per layer and k
= ``K``, random weights: a graph's cost depends on the numbers of tokens, active
features (k per layer and token) and logits, not on what the features mean. The prompts are the demo corpus's distinct passages, each cut after
its first ``TOKENS`` tokens (``graphs.stage.cut_prompts``; BOS counted), cycled when more
are asked for than there are passages.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

from .common import table, worker_peak_rss

N_LATENTS, K, TOKENS = 128, 4, 32
MAX_FEATURES = int(os.environ.get("GRAPHS_MAX_FEATURES", 0))
"""Partial attribution's ``max_feature_nodes`` (0: every active feature)."""


def _inputs(root: Path, n: int):
    import torch
    from transformers import AutoTokenizer

    from pyspark_safetensors.extract.corpus import passages_by_key
    from pyspark_safetensors.extract.toy_lm import TINY, toy_lm
    from pyspark_safetensors.graphs.stage import cut_prompts
    from pyspark_safetensors.sae.architectures import CrossLayerTranscoder
    from pyspark_safetensors.sae.checkpoint import save_sae

    found = _demo_run()
    if found:
        model, clt_path = found
        source = "the CLT demo's toy Llama and CLT"
    else:
        model = toy_lm(Path(tempfile.gettempdir()) / "pss-bench-toy-lm", TINY)
        d, L = TINY.hidden_size, TINY.num_layers
        hooks = [f"model.layers.{i}.mlp:input" for i in range(L)]
        clt = CrossLayerTranscoder(d, N_LATENTS, K, d_out=d, n_layers=L, seed=0, hook_points=hooks)
        gen = torch.Generator().manual_seed(1)
        clt.load_full_state({n: t + 0.1 * torch.randn(t.shape, generator=gen)
                             for n, t in clt.full_state().items()})  # fmt: skip
        clt_path = root / "clt.safetensors"
        save_sae(clt_path, clt.full_state(), clt.metadata())
        source = f"the tiny toy Llama, a random CLT {N_LATENTS} x {K}"
    tokenizer = AutoTokenizer.from_pretrained(model)
    texts = cut_prompts(tokenizer, passages_by_key(0, 1 << 30, 400), TOKENS)
    texts = [t for t in texts if len(tokenizer(t)["input_ids"]) == TOKENS]
    return model, clt_path, [texts[i % len(texts)] for i in range(n)], len(texts), source


def _demo_run() -> tuple[Path, Path] | None:
    """(model directory, CLT file) of a ``conf/pipeline-clt.toml`` demo run
    (``CIRCUIT_TRACER_RUN``, default ``runs/clt``), if there is one."""
    from .bench_circuit_tracer import _demo_run as found

    return found()


def _job(config, prompts: list[str]) -> tuple[float, float, dict]:
    """One fresh local[2] session's job: seconds, worker peak RSS (MB), summary."""
    from pyspark_safetensors.graphs.job import run_graphs
    from pyspark_safetensors.spark.session import local_session

    spark = local_session("local[2]", quick_jit=True)
    try:
        frame = spark.createDataFrame([(p,) for p in prompts], "prompt string")
        started = time.perf_counter()
        summary = run_graphs(spark, config, frame)
        seconds = time.perf_counter() - started
        return seconds, worker_peak_rss(spark), summary
    finally:
        spark.stop()


def _loop(config, prompts: list[str], threads: int) -> tuple[float, list[dict]]:
    import dataclasses
    import gc

    import torch

    from pyspark_safetensors.graphs.job import graph_row

    config = dataclasses.replace(config, threads=threads)
    graph_row(config, 0, prompts[0])  # the model loaded, untimed
    gc.freeze()  # as the job's workers do once the model is loaded
    started = time.perf_counter()
    rows = [graph_row(config, i, p) for i, p in enumerate(prompts)]
    seconds = time.perf_counter() - started
    torch.set_num_threads(os.cpu_count() or 1)
    return seconds, rows


def _measure(root: Path, counts: list[int], n_loop: int) -> dict:
    from pyspark_safetensors.graphs.job import GraphsConfig

    model, clt, prompts, distinct, source = _inputs(root, max(counts))
    jobs = {}
    for n in counts:
        out = root / f"graphs-{n}"
        config = GraphsConfig(str(model), (str(clt),), str(out), partitions=2, threads=1,
                              max_feature_nodes=MAX_FEATURES)  # fmt: skip
        seconds, rss, summary = _job(config, prompts[:n])
        size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
        jobs[n] = {"seconds": seconds, "rss": rss, "graphs": summary["graphs"],
                   "failed": summary["failed"], "bytes": size}  # fmt: skip
        shutil.rmtree(out)
    base = GraphsConfig(str(model), (str(clt),), str(root / "unused"),
                        max_feature_nodes=MAX_FEATURES)  # fmt: skip
    loops = {t: _loop(base, prompts[:n_loop], t) for t in (1, 2)}
    rows = loops[1][1]
    return {"jobs": jobs, "loops": {t: s for t, (s, _) in loops.items()}, "n_loop": n_loop,
            "distinct": distinct, "source": source, "nodes": sum(r["n_nodes"] for r in rows) / len(rows),
            "features": sum(r["n_features"] for r in rows) / len(rows),
            "active": sum(r["n_active"] for r in rows) / len(rows)}  # fmt: skip


def run() -> str:
    counts = [int(n) for n in os.environ.get("GRAPHS_PROMPTS", "250,1000").split(",")]
    n_loop = int(os.environ.get("GRAPHS_LOOP", "250"))
    env = [f"{k}={os.environ[k]}" for k in ("GRAPHS_PROMPTS", "GRAPHS_LOOP", "GRAPHS_MAX_FEATURES")
           if k in os.environ]  # fmt: skip
    command = " ".join([*env, "python -m benchmarks graphs"])
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        m = _measure(Path(tmp), counts, n_loop)
    load = f"{load:.2f} before, {os.getloadavg()[0]:.2f} after"
    rows = []
    for t, seconds in m["loops"].items():
        rows.append([f"loop, one process, {t} torch thread{'s' * (t > 1)}", m["n_loop"],
                     f"{seconds:.1f}", f"{1e3 * seconds / m['n_loop']:.1f}", "", ""])  # fmt: skip
    for n, j in m["jobs"].items():
        rows.append(["Spark job, local[2], 1 thread per task, written", n, f"{j['seconds']:.1f}",
                     f"{1e3 * j['seconds'] / n:.1f}", f"{j['rss']:,.0f}",
                     f"{j['bytes'] / 1e6:,.0f}"])  # fmt: skip
    best = min(m["loops"].values()) / m["n_loop"]
    largest = max(m["jobs"])
    ratio = best / (m["jobs"][largest]["seconds"] / largest)
    refused = sum(j["failed"] for j in m["jobs"].values())
    rss = [j["rss"] for j in m["jobs"].values()]
    memory = (
        "a worker's peak memory does not grow with the prompts (each graph is made, written "
        "and dropped)"
        if max(rss) <= 1.05 * min(rss)
        else f"a worker's peak memory grows from {min(rss):,.0f} to {max(rss):,.0f} MB"
    )
    header = ["run", "prompts", "seconds", "ms per prompt", "worker peak RSS (MB)", "written (MB)"]
    return (
        f"## Attribution graphs: {largest:,} prompts of {TOKENS} tokens, {m['source']}\n\n"
        + table(header, rows)
        + f"\n\nAt {largest:,} prompts the faster loop takes {ratio:.2f}x the Spark job's time "
        f"per prompt; {memory}, and what is written is mostly the unpruned adjacencies "
        f"(N x N float32 each). {m['distinct']} distinct passages of {TOKENS} tokens"
        f"{', cycled' if largest > m['distinct'] else ''}; "
        f"{m['active']:.0f} active features, {m['features']:.0f} attributed "
        f"(max_feature_nodes {MAX_FEATURES or 'all'}) and {m['nodes']:.0f} nodes per graph on "
        f"average; {refused} prompts refused. The loops ran on the first {m['n_loop']} "
        "prompts (their time per prompt is steady: every prompt has the same shape), after "
        "an untimed warm-up prompt; the Spark jobs' seconds include starting the workers "
        "and loading the model in each, the RSS job runs after. Load average (1 min) "
        f"{load}. Command: `{command}`."
    )
