"""The research pipeline on a causal LM, through the real CLI: the tiny toy Llama trained
as the pipeline's first stage, SAEs on the inputs of layer 1's attention and MLP
projections, a skip transcoder replacing layer 0's MLP and a crosscoder over the two SAEs'
hook points, LUTs named as the LUT spec names a Llama's layers (layer 0's MLP block
whole), and the LM-loss evaluation (CE loss recovered, KL) per hook point and per
replaced block in the summary and the report; the crosscoder's feature browser."""

import json
import math
import os
import subprocess
import sys

import pytest

from pyspark_safetensors.lut import validate_lut

pytestmark = pytest.mark.integration

ATTN, MLP = "model.layers.1.self_attn.q_proj:input", "model.layers.1.mlp.gate_proj:input"
CONFIG = f"""
[pipeline]
model = "toy-llama"
texts = 12
held_out_texts = 6
max_length = 0
master = "local[1]"
nproc = 1
epochs = 1
ms = [0, 8]
features = false
llama3_8b_latency = false
[pipeline.transcoders]
"model.layers.0.mlp" = {{ input = "model.layers.0.mlp:input", target = "model.layers.0.mlp:output", skip = true }}
[pipeline.crosscoders]
"layer-1-inputs" = ["model.layers.1.self_attn.q_proj:input", "model.layers.1.mlp.gate_proj:input"]
[pipeline.hooks]
"{ATTN}" = ["model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj",
            "model.layers.1.self_attn.v_proj"]
"{MLP}" = ["model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj"]
[toy_lm]
preset = "tiny"
steps = 200  # enough that layer 1's attention matters: zero-ablating it costs loss
[sae]
expansion_factor = 2
k = 8
batch_size = 128
log_every = 2
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    work = tmp_path_factory.mktemp("pipeline-llama")
    (work / "llama.toml").write_text(CONFIG)
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable}
    result = subprocess.run(
        [sys.executable, "-m", "pyspark_safetensors.cli", "pipeline", "--config", "llama.toml",
         "--out", "run"],
        cwd=work, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return work / "run"


def test_lut_files_carry_the_spec_llama_names(run):
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stages"]["model"]["dir"].startswith("model-")
    assert summary["toy_lm"]["config"]["steps"] == 200  # the preset's fields overridden
    assert summary["source_model"].startswith("toy-llama-")
    meta = validate_lut(run / "lut" / "lut")
    assert sorted(meta["layers"]) == sorted(
        [f"model.layers.1.self_attn.{p}_proj" for p in "qkv"]
        + [f"model.layers.1.mlp.{p}_proj" for p in ("gate", "up")]
        + ["model.layers.0.mlp"]  # the whole block, from its transcoder
    )
    for layer in meta["layers"]:
        assert (run / "lut" / "lut" / f"{layer}.lut.safetensors").is_file()
    assert meta["model_config"]["model_type"] == "llama"
    assert meta["model_config"]["num_layers"] == 2  # the tiny preset's


def test_summary_and_report_hold_the_lm_loss_per_hook_point(run):
    summary = json.loads((run / "summary.json").read_text())
    ev = summary["evaluation"]
    assert "embedding_cosine" not in ev  # an encoder's figure, not a causal LM's
    lm = ev["lm_loss"]
    assert lm["tokens"] > 0 and math.isfinite(lm["ce_clean"])
    # the toy model beats the unigram baseline on its held-out texts
    assert summary["toy_lm"]["held_out_loss"] < summary["toy_lm"]["unigram_held_out_loss"]
    assert set(lm["hooks"]) == {ATTN, MLP}
    for h in lm["hooks"].values():
        values = [h[k] for k in ("ce_spliced", "ce_zero_ablated", "ce_mean_ablated",
                                 "ce_loss_recovered", "kl_spliced", "kl_zero_ablated")]  # fmt: skip
        assert all(math.isfinite(v) for v in values)
        assert lm["ce_clean"] < h["ce_zero_ablated"]
        assert 0 <= h["kl_spliced"] < h["kl_zero_ablated"]  # the SAE beats ablation
        assert h["ce_loss_recovered"] == pytest.approx(
            (h["ce_zero_ablated"] - h["ce_spliced"]) / (h["ce_zero_ablated"] - lm["ce_clean"])
        )
    assert set(lm["lut"]) == {"0", "8"}
    assert all(math.isfinite(v["ce"]) and v["kl"] >= 0 for v in lm["lut"].values())
    report = (run / "report.md").read_text()
    assert "## Language-model loss" in report and "Sentence embeddings" not in report
    assert "CE loss recovered" in report and "KL spliced" in report and "toy Llama" in report
    for hook in (ATTN, MLP):  # the loss table's row of each hook point
        recovered = f"**{lm['hooks'][hook]['ce_loss_recovered']:.3f}**"
        assert any(
            line.startswith(f"| `{hook}`") and recovered in line for line in report.splitlines()
        )


def test_the_transcoder_replaces_its_mlp_and_the_crosscoder_is_set_beside_the_saes(run):
    summary = json.loads((run / "summary.json").read_text())
    block, cross = "model.layers.0.mlp", "layer-1-inputs"
    assert summary["training"][block]["kind"] == "transcoder"
    assert summary["stages"]["transcoder-model_layers_0_mlp"]["dir"].startswith("transcoder-")
    ev = summary["evaluation"]
    t = ev["transcoders"][block]
    assert t["target"] == "model.layers.0.mlp:output" and 0 < t["fvu"] < 1 and t["l0"] > 0
    c = ev["crosscoders"][cross]
    assert set(c["sae_fvu"]) == {ATTN, MLP}
    assert all(0 < c[f"fvu_{hook}"] < 1 for hook in (ATTN, MLP))
    mlp = ev["lm_loss"]["mlp"][block]
    # the transcoder and its LUT stand in for the block better than ablating it
    assert mlp["kl_spliced"] < mlp["kl_zero_ablated"] and mlp["kl_lut"] < mlp["kl_zero_ablated"]
    assert mlp["ce_loss_recovered"] == pytest.approx(
        (mlp["ce_zero_ablated"] - mlp["ce_spliced"])
        / (mlp["ce_zero_ablated"] - ev["lm_loss"]["ce_clean"])
    )
    assert [r["tokens"] for r in ev["mlp_latency"][block]] == [1, 512]
    report = (run / "report.md").read_text()
    for section in ("## Transcoders", "## Crosscoders", "## MLP blocks replaced whole",
                    "## MLP LUT latency"):  # fmt: skip
        assert section in report
    recovered = f"**{mlp['ce_loss_recovered']:.3f}**"
    assert any(
        line.startswith(f"| `{block}`") and recovered in line for line in report.splitlines()
    )


def test_the_crosscoder_gets_a_feature_browser_the_report_links(run, monkeypatch):
    """The pipeline's features stage on the crosscoder it trained (the run leaves
    features off, where each browser costs seconds): every extracted token's rows of both
    hook points, found from those its checkpoint records, one code over them; the
    summary's entry and the report's link."""
    from pyspark_safetensors.pipeline import Pipeline, PipelineConfig
    from pyspark_safetensors.pipeline.report import render_report
    from pyspark_safetensors.pipeline.run import TrainingRun

    monkeypatch.chdir(run.parent)  # the run's paths are relative to where it ran
    summary = json.loads((run / "summary.json").read_text())
    config = PipelineConfig.load("llama.toml", out="run", features=True, features_top_n=4)
    pipeline = Pipeline(config, log=lambda line: None)
    pipeline.summary = summary
    cross = TrainingRun("crosscoder", "layer-1-inputs", (ATTN, MLP))
    extract = run / summary["stages"]["extract"]["dir"] / "data"
    sae = run / summary["stages"][cross.stage]["dir"] / "sae.safetensors"
    pipeline.features({cross: sae}, extract)
    f = summary["features"][cross.name]
    assert f["kind"] == "crosscoder" and f["hooks"] == [ATTN, MLP]
    assert f["dir"].startswith("features-crosscoder-layer-1-inputs-")
    browser = run / f["dir"] / "features"
    doc = json.loads((browser / "features.json").read_text())
    extraction = json.loads((extract / "extraction.json").read_text())
    assert doc["architecture"] == "crosscoder" and doc["summary"]["hook"] == f"{ATTN} + {MLP}"
    assert doc["datasets"] == [
        str(extract / extraction["hooks"][h]["dataset"]) for h in (ATTN, MLP)
    ]
    assert f["tokens"] == doc["summary"]["tokens"] == summary["extraction"]["tokens"]
    assert f["latents"] == doc["summary"]["latents"] > f["dead"]
    assert (browser / "index.html").is_file()
    link = f"{f['dir']}/features/index.html"
    assert any(
        line.startswith(f"- `{cross.name}` (crosscoder over `{ATTN}`, `{MLP}`): [{link}]")
        for line in render_report(summary).splitlines()
    )
