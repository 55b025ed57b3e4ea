"""The Spark job: four prompts (one empty, one longer than the model's context) through
the local session; the graphs as parquet and a safetensors dataset, readable in SQL, and
the same as one prompt's graph made here. The feature job on one layer of the CLT, and the
browser's link from a feature node to that latent's feature page."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from conftest import CLT_LAYER, N_LATENTS, K, random_clt
from pyspark_safetensors.circuits import ReplacementModel
from pyspark_safetensors.features import FeaturesConfig, FeaturesError, plan_features
from pyspark_safetensors.features.scan import RowReader
from pyspark_safetensors.graphs.attribution import attribute
from pyspark_safetensors.graphs.job import GraphsConfig, run_graphs
from pyspark_safetensors.torch import open_dataset

pytestmark = pytest.mark.spark

PROMPTS = ["The quick brown fox", "", "import os " * 40, "def main():"]


def test_graphs_of_prompts_in_spark(spark, toy, dictionaries, tmp_path):
    out = tmp_path / "graphs"
    config = GraphsConfig(model=str(toy), transcoders=(str(dictionaries["clt"]),),
                          output=str(out), partitions=2)  # fmt: skip
    prompts = spark.createDataFrame([(p,) for p in PROMPTS], "prompt string")
    summary = run_graphs(spark, config, prompts)
    assert summary["graphs"] == 2 and summary["failed"] == 2
    refused = summary["errors"]
    assert [(e["prompt_id"], e["prompt"]) for e in refused] == [(1, ""), (2, PROMPTS[2])]
    assert refused[0]["error"] == "an empty prompt"
    assert refused[1]["error"].startswith("a prompt of") and "exceeds" in refused[1]["error"]
    assert json.loads((out / "graphs.json").read_text())["graphs"] == 2
    rows = spark.read.parquet(str(out / "graphs.parquet")).orderBy("prompt_id").collect()
    assert [r.status for r in rows] == ["ok", "error", "error", "ok"]
    assert [r.prompt for r in rows] == PROMPTS
    assert all(0 < r.replacement_score < 1 for r in rows if r.status == "ok")
    ok = [r.replacement_score for r in rows if r.status == "ok"]
    replacement = summary["scores"]["replacement"]
    assert replacement == pytest.approx({"mean": sum(ok) / 2, "min": min(ok)})
    spark.read.parquet(str(out / "nodes")).createOrReplaceTempView("nodes")
    per_prompt = spark.sql(
        "SELECT prompt_id, count(*) AS n, sum(CAST(kept AS INT)) AS kept FROM nodes "
        "WHERE kind = 'feature' GROUP BY prompt_id ORDER BY prompt_id"
    ).collect()
    assert [r.prompt_id for r in per_prompt] == [0, 3]
    assert all(0 < r.kept < r.n for r in per_prompt)
    # the job's graph of prompt 3 is the one made here
    rm = ReplacementModel.load(toy, dictionaries["clt"])
    want = attribute(rm, rm.tokenizer(PROMPTS[3])["input_ids"])
    got = open_dataset(str(out / "adjacency"))["p3"]["adjacency"]
    np.testing.assert_allclose(torch.as_tensor(got).numpy(), want.adjacency, rtol=1e-5, atol=1e-6)
    edges = spark.read.parquet(str(out / "edges")).where("prompt_id = 3").collect()
    got = torch.as_tensor(got).numpy()  # the pruned graph's edges are the stored adjacency's
    assert edges and all(got[e.target, e.source] == np.float32(e.weight) for e in edges)


def test_the_graph_browser_in_headless_chromium(spark, toy, dictionaries, clt_features, tmp_path):
    from pyspark_safetensors.features.screenshot import chromium, chromium_missing

    missing = chromium_missing()
    if missing:
        pytest.skip(f"no headless Chromium: {missing}")
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    out = tmp_path / "graphs"
    pages = os.path.relpath(clt_features[1].parent, out) + "/layer{layer}/index.html#{latent}"
    config = GraphsConfig(model=str(toy), transcoders=(str(dictionaries["clt"]),),
                          output=str(out), partitions=1, feature_pages=pages)  # fmt: skip
    run_graphs(spark, config, spark.createDataFrame([("def main():",), ("",)], "prompt string"))
    with chromium() as driver:
        driver.get((out / "index.html").resolve().as_uri())
        rows = driver.find_elements(By.CSS_SELECTOR, "tr.graph-row")
        assert len(rows) == 2 and "refused: an empty prompt" in rows[1].text
        rows[0].click()
        WebDriverWait(driver, 10).until(lambda d: d.find_elements(By.CSS_SELECTOR, ".node"))
        kept = spark.read.parquet(str(out / "nodes")).where("prompt_id = 0 AND kept").count()
        assert len(driver.find_elements(By.CSS_SELECTOR, ".node")) == kept
        edges = spark.read.parquet(str(out / "edges")).where("prompt_id = 0").count()
        assert len(driver.find_elements(By.CSS_SELECTOR, "line.edge")) == edges
        assert "replacement 0." in driver.find_element(By.ID, "scores").text
        logit = driver.find_elements(By.CSS_SELECTOR, ".node.logit")[0]
        driver.execute_script("arguments[0].dispatchEvent(new MouseEvent('click'))", logit)
        incoming = driver.find_elements(By.CSS_SELECTOR, "#info tr.incoming")
        assert incoming and "selected" in logit.get_attribute("class")
        assert not driver.find_elements(By.CSS_SELECTOR, "#info a.feature-page")  # a logit: none
        assert_feature_page_link(spark, driver, out)


def assert_feature_page_link(spark, driver, out) -> None:
    """A feature node of layer ``CLT_LAYER`` links to its latent's page, which opens it."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    node = (spark.read.parquet(str(out / "nodes"))
            .where(f"prompt_id = 0 AND kept AND kind = 'feature' AND layer = {CLT_LAYER}")
            .orderBy("node").first())  # fmt: skip
    assert node is not None
    circle = driver.find_element(By.CSS_SELECTOR, f".node.feature[data-node='{node.node}']")
    driver.execute_script("arguments[0].dispatchEvent(new MouseEvent('click'))", circle)
    link = driver.find_element(By.CSS_SELECTOR, "#info a.feature-page")
    assert link.text == "feature browser \u2197"
    assert link.get_attribute("href").endswith(f"/layer{CLT_LAYER}/index.html#{node.latent}")
    driver.get(link.get_attribute("href"))
    WebDriverWait(driver, 10).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#detail h2"))
    assert driver.find_element(By.CSS_SELECTOR, "#detail h2").text == f"Latent #{node.latent}"


def test_a_clt_layer_s_latents_are_its_top_k_code(clt_features, dictionaries):
    acts, out = clt_features
    config = FeaturesConfig(extraction=str(acts), sae=str(dictionaries["clt"]), clt_layer=CLT_LAYER)
    plan = plan_features(config)
    assert plan.hook == f"model.layers.{CLT_LAYER}.mlp:input" and plan.n_latents == N_LATENTS
    ds = open_dataset(plan.dataset)
    x, _ = RowReader(ds, plan.width).read(0, len(ds))
    codes = random_clt().encode_layer(CLT_LAYER, torch.from_numpy(x))
    assert ((codes > 0).sum(1) <= K).all()
    got = pq.read_table(out / "latents.parquet").to_pandas().sort_values("latent")
    assert len(got) == N_LATENTS and json.loads((out / "features.json").read_text())
    fired = (codes > 0).sum(0).numpy()
    assert (got["count"].to_numpy() == fired).all() and fired.sum() > len(x)
    torch.testing.assert_close(torch.tensor(got["max"].to_numpy(), dtype=torch.float32),
                               codes.max(0).values, rtol=1e-4, atol=1e-5)  # fmt: skip


def test_a_clt_needs_a_layer_and_only_a_clt_takes_one(clt_features, dictionaries):
    acts, _ = clt_features
    with pytest.raises(FeaturesError, match=r"clt_layer: .* set clt_layer to one of 0\.\.1"):
        plan_features(FeaturesConfig(extraction=str(acts), sae=str(dictionaries["clt"])))
    with pytest.raises(FeaturesError, match="not a cross-layer transcoder"):
        plan_features(FeaturesConfig(extraction=str(acts), sae=str(dictionaries["per_layer"][1]),
                                     clt_layer=1))  # fmt: skip
