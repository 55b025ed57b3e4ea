"""The pipeline's CLT stage: the config's ``[pipeline.clts]`` planned as a CLT run and a
transcoder per block on the same hook points, and ``clt_figures`` on the tiny toy Llama
(random dictionaries: the stage's plumbing, not their quality)."""

from dataclasses import replace

import pytest
import torch

pytest.importorskip("transformers")

from pyspark_safetensors.circuits.stage import clt_figures
from pyspark_safetensors.extract.toy_lm import TINY, toy_lm, toy_lm_texts
from pyspark_safetensors.lut import precompute_lut
from pyspark_safetensors.pipeline.errors import PipelineError
from pyspark_safetensors.pipeline.run import PipelineConfig
from pyspark_safetensors.sae import CrossLayerTranscoder, TranscoderSAE
from pyspark_safetensors.sae.checkpoint import save_sae

L, D, N, K = TINY.num_layers, TINY.hidden_size, 16, 4
BLOCKS = [f"model.layers.{i}.mlp" for i in range(L)]


def test_a_clt_table_plans_the_clt_and_its_per_layer_baseline():
    config = PipelineConfig(model="toy-llama", toy_lm={"preset": "tiny"}, hooks={},
                            clts={"all": {"layers": "all"}})  # fmt: skip
    runs = config.runs
    assert [(r.kind, r.name) for r in runs] == [("clt", "all")] + [
        ("transcoder", b) for b in BLOCKS
    ]
    assert runs[0].hooks == (*(f"{b}:input" for b in BLOCKS), *(f"{b}:output" for b in BLOCKS))
    assert runs[0].architecture == "clt" and runs[0].stage == "clt-all"
    assert set(config.extracted_hooks) == set(runs[0].hooks)
    only = PipelineConfig(model="toy-llama", toy_lm={"preset": "tiny"}, hooks={},
                          clts={"one": {"layers": "1", "per_layer": False}})  # fmt: skip
    assert [r.hooks for r in only.runs] == [(f"{BLOCKS[1]}:input", f"{BLOCKS[1]}:output")]
    with pytest.raises(PipelineError, match="only layers and per_layer"):
        PipelineConfig(hooks={}, clts={"x": {"layer": "all"}})


def _random(module, seed):
    gen = torch.Generator().manual_seed(seed)
    state = {
        n: t + 0.2 * torch.randn(t.shape, generator=gen) for n, t in module.full_state().items()
    }
    module.load_full_state(state)
    return module


def test_clt_figures_set_the_clt_its_lut_and_the_per_layer_baseline_side_by_side(
    tmp_path, tmp_path_factory, seed
):
    # the toy model test_replacement trains, cached in the session's base directory
    model_dir = toy_lm(tmp_path_factory.getbasetemp() / "toy-lm", replace(TINY, seed=seed))
    clt = _random(CrossLayerTranscoder(D, N, K, d_out=D, n_layers=L,
                                       hook_points=[f"{b}:input" for b in BLOCKS]), 1)  # fmt: skip
    save_sae(tmp_path / "clt.safetensors", clt.full_state(), clt.metadata())
    tcs = {}
    for i, block in enumerate(BLOCKS):
        tc = _random(TranscoderSAE(D, N, K, d_out=D), 2 + i)
        tcs[block] = tmp_path / f"tc{i}.safetensors"
        save_sae(tcs[block], tc.full_state(), {**tc.metadata(), "k": str(K)})
    precompute_lut(model_dir, tcs, out_dir=tmp_path / "per-layer-lut", k_active=K,
                   progress=False)  # fmt: skip
    figures = clt_figures(model_dir=model_dir, clt_file=tmp_path / "clt.safetensors",
                          transcoders=tcs, per_layer_lut=tmp_path / "per-layer-lut",
                          texts=toy_lm_texts(TINY)[1][:4], max_length=0,
                          out_dir=tmp_path / "stage")  # fmt: skip
    models = ["clt", "clt_threshold", "clt_lut", "per_layer", "per_layer_lut"]
    assert list(figures["models"]) == models
    assert figures["latents"]["clt"] == {"total": L * N, "k_per_layer": K, "layers": L}
    assert figures["latents"]["per_layer"] == figures["latents"]["clt"]
    m = figures["models"]
    assert abs(m["clt"]["ce"] - m["clt_lut"]["ce"]) < 2e-3 * m["clt"]["ce"]
    assert abs(m["per_layer"]["ce"] - m["per_layer_lut"]["ce"]) < 2e-3 * m["per_layer"]["ce"]
    assert m["clt"]["ce"] != pytest.approx(m["per_layer"]["ce"], rel=1e-4)
    assert (tmp_path / "stage" / "lut" / "metadata.json").is_file()
    assert figures["tokens"] > 0 and set(figures["blocks"]) == set(BLOCKS)
