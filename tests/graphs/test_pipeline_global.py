"""The pipeline's CLT stages after the graphs, on the tiny toy Llama and its random CLT
(their plumbing, not their quality): a feature browser per layer of the CLT
(``clt_features``), graphs whose feature nodes link to them, the global weights stage
(virtual weights, expected attributions, each layer's ``links/layer{block}.js``), the
report's sections; in headless Chromium a graph's feature node opens its latent's page in
its layer's browser, which lists that feature's strongest inputs and outputs, each a link
that opens its own page. The per-layer transcoders' patterns are checked without a run."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pyspark_safetensors.extract.toy_lm import TINY
from pyspark_safetensors.pipeline.run import Pipeline, PipelineConfig, TrainingRun, prepare_out_dir
from spark_sessions import Unstopped

pytestmark = pytest.mark.spark

L = TINY.num_layers
BLOCKS = [f"model.layers.{i}.mlp" for i in range(L)]
HELD_OUT = ["The quick brown fox jumps over the lazy dog", "def main(): return 0"]


def _config(out: Path, dictionaries=("clt",)) -> PipelineConfig:
    return PipelineConfig(out=str(out), model="toy-llama", toy_lm={"preset": "tiny"}, hooks={},
                          clts={"all": {"layers": "all"}}, features=True, features_top_n=3,
                          graphs={"dictionaries": list(dictionaries), "n_prompts": 2, "tokens": 8,
                                  "node_threshold": 0.99},  # the random CLT's later layers kept
                          master="local[1]")  # fmt: skip


@pytest.fixture(scope="module")
def run(spark, toy, dictionaries, tmp_path_factory):
    """The CLT's stages of a pipeline over the toy's MLP inputs: ``(output dir, summary)``."""
    from pyspark_safetensors.extract import ExtractConfig, run_extraction
    from pyspark_safetensors.spark import session

    root = tmp_path_factory.mktemp("pipeline-global")
    extract = root / "acts"
    config = ExtractConfig(model=str(toy), hooks=tuple(f"{b}:input" for b in BLOCKS), max_length=0,
                           max_texts=6, dtype="F32", rows_per_shard=256, kv_dataset=False)  # fmt: skip
    run_extraction(spark, config, extract)
    pipeline = Pipeline(_config(root / "run"), log=lambda line: None)
    prepare_out_dir(pipeline.out, force=False)
    pipeline.model_dir, pipeline.model_hash, pipeline.held_out = toy, "toy", HELD_OUT
    clt = TrainingRun("clt", "all", (*(f"{b}:input" for b in BLOCKS),
                                     *(f"{b}:output" for b in BLOCKS)))  # fmt: skip
    for name, key in (("extract", "e"), (clt.stage, "c")):  # the stages before, as done
        pipeline.summary["stages"][name] = {"dir": f"{name}-{key}", "hash": key, "reused": True}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(session, "local_session", lambda *a, **k: Unstopped(spark))
        pipeline.graphs({clt: dictionaries["clt"]})
        pipeline.clt_features(clt, dictionaries["clt"], extract)
        pipeline.global_weights()
    from pyspark_safetensors.pipeline.report import _features, _global_weights, _graphs

    # the report's sections of these stages (the others need the stages not run here)
    sections = [*_graphs(pipeline.summary), *_features(pipeline.summary),
                *_global_weights(pipeline.summary)]  # fmt: skip
    (pipeline.out / "report.md").write_text("\n".join(sections))
    return pipeline.out, pipeline.summary


def test_a_browser_per_clt_layer_and_the_global_weights(run):
    out, summary = run
    features = summary["features"]
    assert sorted(features) == [f"all layer {i}" for i in range(L)]
    for i in range(L):
        f = features[f"all layer {i}"]
        assert f["dir"].startswith(f"features-clt-all-layer{i}-") and f["kind"] == "clt"
        assert f["layer"] == i and f["hooks"] == [f"{BLOCKS[i]}:input"] and f["latents"] == 48
        doc = json.loads((out / f["dir"] / "features" / "features.json").read_text())
        assert doc["summary"]["hook"] == f"{BLOCKS[i]}:input"
        # the stable name the graphs and the pages link to, and the global weights' file
        assert (out / f"features-clt-all-layer{i}" / "features" / "index.html").is_file()
        links = out / f["dir"] / "features" / "data" / "links.js"
        assert (
            links.is_symlink()
            and links.resolve()
            == (out / "global-weights" / "clt" / "links" / f"layer{i}.js").resolve()
        )
    g = summary["global_weights"]["dictionaries"]["clt"]
    where = out / summary["global_weights"]["dir"] / "clt"
    virtual = pq.read_table(where / "virtual_weights").to_pandas()
    expected = pq.read_table(where / "expected_attributions").to_pandas()
    assert len(virtual) == g["virtual_weights"]["pairs"] > 0
    assert len(expected) == g["expected_attributions"]["pairs"] > 0
    assert (
        g["expected_attributions"]["graphs"] == summary["graphs"]["dictionaries"]["clt"]["graphs"]
    )
    assert (where / "expected_attributions" / "_expected_attributions.json").is_file()
    top = g["strongest"]["expected_attributions"][0]
    assert abs(top["sum"]) == pytest.approx(expected["sum"].abs().max())
    assert set(g["links"]) == {str(i) for i in range(L)}


def test_the_report_links_the_browsers_and_the_global_weights(run):
    out, summary = run
    report = (out / "report.md").read_text()
    assert "## Global weights" in report and "Strongest expected attributions (CLT)" in report
    assert "## Feature browsers" in report and "(CLT `all`'s layer 1, on " in report
    targets = re.findall(r"\]\(([^)]+)\)", report)
    gw = summary["global_weights"]["dir"]
    assert f"{gw}/clt/virtual_weights" in targets and f"{gw}/clt/expected_attributions" in targets
    pages = [t for t in targets if t.startswith("features-clt-all-layer")]
    assert pages  # the strongest pairs' features, each a link to its page
    for target in targets:  # every link the report holds resolves
        assert (out / target.split("#")[0]).exists(), target


def test_a_graph_node_opens_its_latent_and_its_links_in_chromium(run):
    from pyspark_safetensors.features.screenshot import chromium, chromium_missing

    missing = chromium_missing()
    if missing:
        pytest.skip(f"no headless Chromium: {missing}")
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    out, summary = run
    graphs = out / summary["graphs"]["dir"] / "clt"
    nodes = pq.read_table(graphs / "nodes").to_pandas()
    # a kept feature node of the highest layer that has one (above the first: it has inputs)
    kept = nodes[(nodes.kind == "feature") & nodes.kept & (nodes.layer >= 1)]
    assert len(kept), "the pruned graphs keep no feature above the first layer"
    feature = kept.sort_values(["layer", "prompt_id", "node"]).iloc[-1]
    node = feature[["prompt_id", "node", "latent", "layer"]].astype(int)
    top = int(node.layer)
    links = json.loads(
        (out / "global-weights" / "clt" / "links" / f"layer{top}.js").read_text().split(" = ", 1)[1].rstrip(";\n")
    )  # fmt: skip
    with chromium() as driver:
        driver.get((graphs / "graph.html").resolve().as_uri() + f"#{node.prompt_id}")
        WebDriverWait(driver, 10).until(lambda d: d.find_elements(By.CSS_SELECTOR, ".node"))
        circle = driver.find_element(By.CSS_SELECTOR, f".node.feature[data-node='{node.node}']")
        driver.execute_script("arguments[0].dispatchEvent(new MouseEvent('click'))", circle)
        href = driver.find_element(By.CSS_SELECTOR, "#info a.feature-page").get_attribute("href")
        assert href.endswith(f"/features-clt-all-layer{top}/features/index.html#{node.latent}")
        driver.get(href)
        WebDriverWait(driver, 10).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#detail h2"))
        assert driver.find_element(By.CSS_SELECTOR, "#detail h2").text == f"Latent #{node.latent}"
        # its strongest inputs: virtual weights and the graphs' expected attributions
        want = links["latents"][str(node.latent)]["inputs"]
        tables = driver.find_elements(By.CSS_SELECTOR, "table.links-table[data-side='inputs']")
        assert {t.get_attribute("data-kind") for t in tables} == set(want)
        first = driver.find_element(By.CSS_SELECTOR, "table.links-table[data-side='inputs'] a")
        layer, latent = first.get_attribute("data-layer"), first.get_attribute("data-latent")
        assert [int(layer), int(latent)] == want["virtual"][0][:2] and int(layer) < top
        driver.get(first.get_attribute("href"))  # another layer's browser, that latent open
        WebDriverWait(driver, 10).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#detail h2"))
        assert driver.find_element(By.CSS_SELECTOR, "#detail h2").text == f"Latent #{latent}"
        assert f"features-clt-all-layer{layer}/" in driver.current_url
        outputs = driver.find_elements(By.CSS_SELECTOR, "table.links-table[data-side='outputs'] a")
        assert outputs  # an earlier layer's feature feeds later ones


def test_the_per_layer_transcoders_pages_and_links(tmp_path):
    pipeline = Pipeline(_config(tmp_path / "run", ("clt", "per_layer")), log=lambda line: None)
    stage = pipeline.config.graphs_stage()
    assert pipeline.feature_pages(stage) == {
        "clt": "../../features-clt-all-layer{layer}/features/index.html#{latent}",
        "per_layer": "../../features-transcoder-model_layers_{layer}_mlp/features/index.html#{latent}",
    }
    tc = TrainingRun("transcoder", BLOCKS[1], (f"{BLOCKS[1]}:input", f"{BLOCKS[1]}:output"))
    assert pipeline.links_target(tc, 1) == "../../../global-weights/per_layer/links/layer1.js"
    other = TrainingRun("transcoder", "model.layers.7.mlp", ("a", "b"))
    assert pipeline.links_target(other, 7) == ""
    only_clt = Pipeline(_config(tmp_path / "clt"), log=lambda line: None)
    assert only_clt.links_target(tc, 1) == ""  # no per-layer graphs: no global weights of it
