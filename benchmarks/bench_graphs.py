"""Attribution graphs of many prompts: the Spark job (``graphs.job.run_graphs``, local
session, one task per core, the model and transcoders loaded once per worker) against a
loop over the prompts in one process (the same model loaded once, the same graph, pruning
and scores per prompt, nothing written).

    python -m benchmarks graphs
    GRAPHS_PROMPTS=100 python -m benchmarks graphs

The model is the package's tiny toy Llama (``extract.toy_lm``'s ``TINY``: 2 layers,
hidden 32, trained here once and cached under the temporary directory); the CLT has
``N_LATENTS`` latents per layer and k = ``K``, random weights: a graph's cost depends on
the numbers of tokens, active features (k per layer and token) and logits, not on what the
features mean. The prompts are the first ``CHARS`` characters of the demo corpus's
passages, cycled.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from .common import table

N_LATENTS, K, CHARS = 128, 4, 80


def _inputs(root: Path):
    import torch

    from pyspark_safetensors.extract.corpus import passages_by_key
    from pyspark_safetensors.extract.toy_lm import TINY, toy_lm
    from pyspark_safetensors.sae.architectures import CrossLayerTranscoder
    from pyspark_safetensors.sae.checkpoint import save_sae

    model = toy_lm(Path(tempfile.gettempdir()) / "pss-bench-toy-lm", TINY)
    d, L = TINY.hidden_size, TINY.num_layers
    hooks = [f"model.layers.{i}.mlp:input" for i in range(L)]
    clt = CrossLayerTranscoder(d, N_LATENTS, K, d_out=d, n_layers=L, seed=0, hook_points=hooks)
    gen = torch.Generator().manual_seed(1)
    clt.load_full_state({n: t + 0.1 * torch.randn(t.shape, generator=gen)
                         for n, t in clt.full_state().items()})  # fmt: skip
    save_sae(root / "clt.safetensors", clt.full_state(), clt.metadata())
    n = int(os.environ.get("GRAPHS_PROMPTS", "1000"))
    texts = [p[:CHARS] for p in passages_by_key(0, 1 << 30, 400)]
    return model, root / "clt.safetensors", [texts[i % len(texts)] for i in range(n)]


def run() -> str:
    from pyspark_safetensors.graphs.job import GraphsConfig, graph_row, run_graphs
    from pyspark_safetensors.spark.session import local_session

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model, clt, prompts = _inputs(root)
        config = GraphsConfig(str(model), (str(clt),), str(root / "graphs"))
        started = time.perf_counter()
        rows = [graph_row(config, i, p) for i, p in enumerate(prompts)]
        loop = time.perf_counter() - started
        spark = local_session("local[2]", quick_jit=True)
        try:
            df = spark.createDataFrame([(p,) for p in prompts], "prompt string")
            started = time.perf_counter()
            summary = run_graphs(spark, config, df)
            job = time.perf_counter() - started
        finally:
            spark.stop()
    nodes = sum(r["n_nodes"] or 0 for r in rows) / max(1, len(rows))
    return f"## Attribution graphs: {len(prompts)} prompts, toy Llama, CLT {N_LATENTS} x {K}\n\n" + table(
        ["run", "seconds", "prompts/s"],
        [["loop, one process", f"{loop:.1f}", f"{len(prompts) / loop:.1f}"],
         ["Spark job, local[2], written", f"{job:.1f}", f"{len(prompts) / job:.1f}"]],
    ) + f"\n\n{summary['graphs']} graphs, {summary['failed']} refused; {nodes:.0f} nodes per graph on average."  # fmt: skip
