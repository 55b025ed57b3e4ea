"""The pipeline's graphs stage: ``[pipeline.graphs]`` checked with the config, and
``graph_figures`` on the tiny toy Llama with a random CLT
(the stage's plumbing, not their quality): held-out passages cut to a length, a prompts
file with a bad line, the dataset, the scores in the summary, the report's section (the
per-layer transcoders' graphs are test_attribution's and test_job's)."""

from __future__ import annotations

import json

import pytest

from pyspark_safetensors.features.screenshot import chromium_missing
from pyspark_safetensors.graphs.stage import GraphsStage, cut_prompts, graph_figures
from pyspark_safetensors.pipeline.errors import PipelineError
from pyspark_safetensors.pipeline.report import _graphs
from pyspark_safetensors.pipeline.run import PipelineConfig

pytestmark = pytest.mark.spark

CLTS = {"all": {"layers": "all"}}


def _config(**graphs) -> PipelineConfig:
    return PipelineConfig(model="toy-llama", toy_lm={"preset": "tiny"}, hooks={}, clts=CLTS,
                          graphs=graphs)  # fmt: skip


def test_the_graphs_table_is_checked_with_the_config():
    stage = _config(dictionaries=["clt", "per_layer"], node_threshold=0.7).graphs_stage()
    assert stage == GraphsStage("all", ("clt", "per_layer"), pruning=(("node_threshold", 0.7),))
    for table, message in [({"prompt": "x"}, "unknown setting"), ({"clt": "none"}, "clt must"),
                           ({"dictionaries": ["sae"]}, "dictionaries must"),
                           ({"tokens": -1}, "tokens >= 0")]:  # fmt: skip
        with pytest.raises(PipelineError, match=message):
            _config(**table)
    with pytest.raises(PipelineError, match="per_layer = true"):
        PipelineConfig(model="toy-llama", toy_lm={"preset": "tiny"}, hooks={},
                       clts={"c": {"per_layer": False}}, graphs={"dictionaries": ["per_layer"]})  # fmt: skip
    hooks = ["model.layers.0.mlp:input", "model.layers.1.mlp:input",
             "model.layers.0.mlp:output", "model.layers.1.mlp:output"]  # fmt: skip
    tcs = {"model.layers.1.mlp": "b.st", "model.layers.0.mlp": "a.st", "model.layers.5.mlp": "c"}
    assert stage.dictionary_files("clt.st", hooks, tcs) == {"clt": ("clt.st",),
                                                           "per_layer": ("a.st", "b.st")}  # fmt: skip


def test_graph_figures_write_the_datasets_and_the_report_links_them(
    spark, toy, dictionaries, tmp_path
):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(toy)
    held_out = ["The quick brown fox jumps over the lazy dog", "def main(): return 0", "x"]
    cut = cut_prompts(tokenizer, held_out, 6)
    assert [len(tokenizer(p)["input_ids"]) for p in cut] == [6, 6, len(tokenizer("x")["input_ids"])]
    assert GraphsStage("all", n_prompts=2, tokens=6).prompt_texts(tokenizer, held_out) == cut[:2]
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The quick brown fox\n\ndef main():\n")
    stage = GraphsStage("all", ("clt",), prompts=str(prompts))
    figures = graph_figures(spark, stage, model_dir=toy, files={"clt": (str(dictionaries["clt"]),)},
                            held_out=held_out, out_dir=tmp_path / "file")  # fmt: skip
    f = figures["clt"]
    assert (f["graphs"], f["failed"], f["prompts"]) == (2, 1, 3)
    assert f["errors"] == [{"prompt_id": 1, "prompt": "", "error": "an empty prompt"}]
    rows = spark.read.parquet(str(tmp_path / "file" / "clt" / "graphs.parquet")).collect()
    scores = sorted(r.completeness_score for r in rows if r.status == "ok")
    assert f["scores"]["completeness"] == pytest.approx({"mean": sum(scores) / 2, "min": scores[0]})
    assert spark.read.parquet(str(tmp_path / "file" / "clt" / "nodes")).count() > 0
    shot = tmp_path / "file" / "clt" / "graph-browser.png"
    assert f["screenshot"] == shot.is_file() == (chromium_missing() is None)
    section = "\n".join(_graphs({"graphs": {"clt": "all", "dir": "file", "dictionaries": figures}}))
    assert "[file/clt/index.html](file/clt/index.html)" in section
    low, high = scores[0], f["scores"]["completeness"]["mean"]
    assert "| 2 / 3 | " in section and f"{high:.3f} / {low:.3f}" in section
    assert 'prompt 1 (""): an empty prompt' in section
    assert json.loads((tmp_path / "file" / "clt" / "graphs.json").read_text())["failed"] == 1
