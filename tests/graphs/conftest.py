"""The toy Llama and small random dictionaries for the attribution-graph tests: random
weights are enough for exactness (nothing here depends on what a feature means)."""

from __future__ import annotations

import pytest
import torch

from pyspark_safetensors.extract.toy_lm import TINY, toy_lm
from pyspark_safetensors.sae.architectures import CrossLayerTranscoder
from pyspark_safetensors.sae.checkpoint import save_sae

N_LATENTS, K = 48, 4


@pytest.fixture(scope="session")
def toy(tmp_path_factory):
    """The tiny toy Llama (the same directory as the other causal-LM tests: trained once)."""
    return toy_lm(tmp_path_factory.getbasetemp() / "toy-lm", TINY)


def random_clt(seed: int = 1) -> CrossLayerTranscoder:
    """A CLT over every block of TINY with small random weights (none zero)."""
    d, L = TINY.hidden_size, TINY.num_layers
    hooks = [f"model.layers.{i}.mlp:input" for i in range(L)]
    clt = CrossLayerTranscoder(d, N_LATENTS, K, d_out=d, n_layers=L, seed=0, hook_points=hooks,
                               target_hook_points=[h.replace("input", "output") for h in hooks])  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    state = {n: t + 0.1 * torch.randn(t.shape, generator=gen) for n, t in clt.full_state().items()}
    clt.load_full_state(state)
    return clt.eval()


@pytest.fixture(scope="session")
def dictionaries(tmp_path_factory):
    """{"clt": the CLT's file, "per_layer": a transcoder file per block, "skip": a skip
    transcoder file per block}."""
    root = tmp_path_factory.mktemp("dictionaries")
    clt = random_clt()
    save_sae(root / "clt.safetensors", clt.full_state(), clt.metadata())
    per_layer = []
    gen = torch.Generator().manual_seed(2)
    for i in range(TINY.num_layers):
        d, n = TINY.hidden_size, N_LATENTS
        t = {"encoder_weight": torch.randn(n, d, generator=gen) / d**0.5,
             "encoder_bias": 0.1 * torch.randn(n, generator=gen),
             "decoder_weight": 0.1 * torch.randn(n, d, generator=gen),
             "decoder_bias": 0.1 * torch.randn(d, generator=gen)}  # fmt: skip
        path = root / f"tc{i}.safetensors"
        save_sae(path, t, {"architecture": "transcoder", "k": str(K),
                           "hook_point": f"model.layers.{i}.mlp:input"})  # fmt: skip
        per_layer.append(path)
    skip = []
    for i in range(TINY.num_layers):  # per-layer skip transcoders: a linear path beside
        d, n = TINY.hidden_size, N_LATENTS
        t = {"encoder_weight": torch.randn(n, d, generator=gen) / d**0.5,
             "encoder_bias": 0.1 * torch.randn(n, generator=gen),
             "decoder_weight": 0.1 * torch.randn(n, d, generator=gen),
             "decoder_bias": 0.1 * torch.randn(d, generator=gen),
             "skip_weight": 0.1 * torch.randn(d, d, generator=gen) / d**0.5}  # fmt: skip
        path = root / f"skip{i}.safetensors"
        save_sae(path, t, {"architecture": "skip_transcoder", "k": str(K),
                           "hook_point": f"model.layers.{i}.mlp:input"})  # fmt: skip
        skip.append(path)
    return {"clt": root / "clt.safetensors", "per_layer": per_layer, "skip": skip}


CLT_LAYER = 0


@pytest.fixture(scope="module")
def clt_features(spark, toy, dictionaries, tmp_path_factory):
    """The feature job on the CLT's layer ``CLT_LAYER``: ``(extraction, its output)``, the
    output at ``features/layer{CLT_LAYER}`` (the layout the graph browser's link pattern names)."""
    from pyspark_safetensors.extract import ExtractConfig, run_extraction
    from pyspark_safetensors.features import FeaturesConfig, run_features

    root = tmp_path_factory.mktemp("clt-features")
    hook = f"model.layers.{CLT_LAYER}.mlp:input"
    config = ExtractConfig(model=str(toy), hooks=(hook,), max_length=0, max_texts=6,
                           dtype="F32", rows_per_shard=256, kv_dataset=False)  # fmt: skip
    run_extraction(spark, config, root / "acts")
    out = root / "features" / f"layer{CLT_LAYER}"
    run_features(spark, FeaturesConfig(extraction=str(root / "acts"), sae=str(dictionaries["clt"]),
                                       out=str(out), clt_layer=CLT_LAYER, top_n=5))  # fmt: skip
    return root / "acts", out


GRAPH_PROMPTS = ["The quick brown fox", "", "def main():", "import os\nimport sys"]
"""The graph job of the export and global-weight tests: three graphs and a refused prompt."""


@pytest.fixture(scope="session")
def graph_job(toy, dictionaries, tmp_path_factory):
    """The graph job over ``GRAPH_PROMPTS`` through the random CLT: its output directory
    (made once per run, on the run's shared local session)."""
    from pyspark_safetensors.graphs.job import GraphsConfig, run_graphs
    from spark_sessions import spark_session

    spark = spark_session("local")

    out = tmp_path_factory.mktemp("graph-job") / "graphs"
    config = GraphsConfig(model=str(toy), transcoders=(str(dictionaries["clt"]),),
                          output=str(out), partitions=2, browser=False)  # fmt: skip
    run_graphs(spark, config, spark.createDataFrame([(p,) for p in GRAPH_PROMPTS], "prompt string"))
    return out
