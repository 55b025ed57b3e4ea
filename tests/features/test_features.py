"""The feature job in Spark on a tiny extraction: its statistics and examples equal the
single-process reference's, its contexts hold the latent's activation on every token,
its outputs are published whole, bad inputs stop it with one line, and the browser
works in a real (headless) Chromium."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pyarrow.parquet as pq
import pytest
from tables import assert_examples_match, assert_latents_match

from pyspark_safetensors.features import FeaturesConfig, FeaturesError, plan_features, run_features
from pyspark_safetensors.features.merge import examples_table, latents_table
from pyspark_safetensors.features.reference import reference_contexts, reference_state

pytestmark = pytest.mark.spark
LATENTS = 96  # the random SAE of conftest.py


@pytest.fixture(scope="module")
def run(spark, extraction, sae_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("features-out") / "features"
    config = FeaturesConfig(
        extraction=str(extraction), sae=str(sae_file), out=str(out), top_n=6, context=4,
        samples_per_band=2, batch_tokens=100,  # several batches per task
    )  # fmt: skip
    summary = run_features(spark, config)
    return config, summary


def test_statistics_and_examples_equal_the_reference(run):
    config, summary = run
    state = reference_state(plan_features(config), config)
    assert summary.tokens == state.tokens > 500
    want = latents_table(state, config).to_pandas()
    got = pq.read_table(summary.out / "latents.parquet").to_pandas().sort_values("latent")
    assert len(got) == LATENTS
    assert_latents_match(got, want)
    assert 0 < got["dead"].sum() < LATENTS and got["dense"].any()  # the page has both kinds
    examples = examples_table(state, config).to_pandas()
    contexts = pq.read_table(summary.out / "contexts.parquet").to_pandas()
    assert_examples_match(contexts, examples)
    top = contexts[contexts.kind == "top"]
    assert top.groupby("latent").size().max() == config.top_n
    assert set(contexts.kind) > {"top"}  # random examples per quantile band too


def assert_contexts_equal(got, want) -> None:
    """Two contexts tables (pandas): the same examples, windows, tokens and centers, the
    activations to float32 rounding."""
    for column in ("latent", "kind", "rank", "sample_id", "window", "token_pos", "center"):
        assert got[column].tolist() == want[column].tolist(), column
    assert [list(t) for t in got["tokens"]] == [list(t) for t in want["tokens"]]
    for a, b in zip(got["acts"], want["acts"], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def dense_code(plan):
    """Every token's activation of every latent (the SAE run over the whole dataset at
    once), by token: ``{(sample_id, window, token_pos): row}`` and the ``[tokens,
    latents]`` matrix."""
    import torch

    from pyspark_safetensors.sae.ecosystem import load_sae_model
    from pyspark_safetensors.torch import open_dataset

    ds = open_dataset(plan.dataset)
    columns = {c: np.concatenate([np.asarray(ds.shard_view(s, c)).reshape(len(ds.shard_view(s, c)), -1)
                                  for s in range(len(ds.paths))])
               for c in ("activation", "sample_id", "window", "token_pos")}  # fmt: skip
    with torch.inference_mode():
        values, indices = load_sae_model(plan.sae).encode(
            torch.from_numpy(columns["activation"].astype(np.float32))
        )
    z = torch.zeros(len(values), plan.n_latents).scatter_(1, indices.long(), values.float())
    rows = {tuple(int(columns[c][i, 0]) for c in ("sample_id", "window", "token_pos")): i
            for i in range(len(z))}  # fmt: skip
    return rows, z.numpy()


def test_contexts_equal_the_loop_and_the_code_of_every_token(run):
    """The one-pass windows (each candidate's context taken while its chunk is encoded)
    equal the single-process loop's contexts, and every activation of every window is
    the latent's on that token when the SAE encodes the whole dataset at once."""
    config, summary = run
    plan = plan_features(config)
    got = pq.read_table(summary.out / "contexts.parquet").to_pandas()
    want = reference_contexts(plan, config, reference_state(plan, config)).to_pandas()
    assert_contexts_equal(got, want)
    rows, z = dense_code(plan)
    checked = 0
    for r in got.itertuples():
        first = r.token_pos - r.center
        for i, act in enumerate(r.acts):
            row = rows.get((r.sample_id, r.window, first + i))
            expected = 0.0 if row is None else z[row, r.latent]  # no activation row: 0
            assert act == pytest.approx(expected, rel=1e-5, abs=1e-6)
            checked += act > 0 and i != r.center
    assert checked > 100  # neighbours fire, not only the example token


def test_a_dataset_out_of_token_order_gives_the_same_contexts(spark, run, extraction, tmp_path):
    """Rows shuffled (not an extraction's order): the first pass cannot see the windows,
    so the second pass re-encodes the example samples; the tables are the same."""
    import shutil

    from pyspark.sql import functions as F

    config, summary = run
    shuffled = tmp_path / "shuffled"
    shutil.copytree(extraction, shuffled, ignore=shutil.ignore_patterns("activations"))
    plan = plan_features(config)
    dataset = os.path.relpath(plan.dataset, extraction)
    spark.read.format("safetensors").load(plan.dataset).orderBy(F.rand(seed=1)).write.format(
        "safetensors"
    ).option("batch_size", 64).mode("overwrite").save(str(shuffled / dataset))
    out = tmp_path / "features"
    again = run_features(spark, dataclasses.replace(config, extraction=str(shuffled), out=str(out)))
    assert again.tokens == summary.tokens
    assert again.second_pass and not summary.second_pass
    assert_contexts_equal(
        pq.read_table(out / "contexts.parquet").to_pandas(),
        pq.read_table(summary.out / "contexts.parquet").to_pandas(),
    )


def test_contexts_hold_the_activation_of_every_token(run):
    config, summary = run
    contexts = pq.read_table(summary.out / "contexts.parquet").to_pylist()
    for row in contexts:
        assert len(row["tokens"]) == len(row["acts"]) <= 2 * config.context + 1
        assert row["acts"][row["center"]] == pytest.approx(row["value"], rel=1e-5)
        assert all(a >= 0 for a in row["acts"]) and max(row["acts"]) > 0
    starts = [r for r in contexts if r["token_pos"] == 0]
    assert starts and all(r["tokens"][r["center"]] == "[CLS]" for r in starts)


def test_outputs_are_published_whole(run):
    _, summary = run
    names = sorted(p.name for p in summary.out.iterdir())
    assert names == ["contexts.parquet", "data", "features.json", "index.html", "latents.parquet"]
    assert not [p for p in summary.out.parent.iterdir() if "staging" in p.name]
    assert (summary.out / "data" / "latents.js").read_text().startswith("window.FEATURE_DATA")
    doc = json.loads((summary.out / "features.json").read_text())
    files = sorted(str(p.relative_to(summary.out)) for p in summary.out.rglob("*") if p.is_file())
    assert doc["files"] == [f for f in files if f != "features.json"]  # it lists every file
    assert doc["summary"]["tokens"] == summary.tokens and doc["architecture"] == "topk"


def test_a_jumprelu_sae_without_k_equals_the_reference_and_its_own_rule(
    spark, extraction, make_jumprelu, tmp_path
):
    """A SAELens JumpReLU SAE (a threshold per latent, no k) through the job: the same
    tables as the single-process loop, and the statistics of its own rule (every latent
    above its threshold, however many per token), recomputed here densely."""
    import torch

    from pyspark_safetensors.sae import read_sae
    from pyspark_safetensors.torch import open_dataset

    sae = make_jumprelu(tmp_path / "saelens")
    assert "k" not in json.loads((sae / "cfg.json").read_text())
    config = FeaturesConfig(
        extraction=str(extraction), sae=str(sae), out=str(tmp_path / "features"), top_n=5,
        context=3, samples_per_band=2, batch_tokens=128,
    )  # fmt: skip
    summary = run_features(spark, config)
    plan = plan_features(config)
    assert (plan.architecture, plan.k) == ("jumprelu", None)
    state = reference_state(plan, config)
    got = pq.read_table(summary.out / "latents.parquet").to_pandas().sort_values("latent")
    want = latents_table(state, config).to_pandas()
    for column in ("latent", "count", "max", "dead", "dense"):
        assert got[column].tolist() == want[column].tolist(), column
    assert [list(h) for h in got["hist"]] == [list(h) for h in want["hist"]]
    keys = ["latent", "kind", "rank", "value", "sample_id", "window", "token_pos"]
    contexts = pq.read_table(summary.out / "contexts.parquet").to_pandas()[keys]
    examples = examples_table(state, config).to_pandas()[keys]
    order = ["latent", "kind", "rank"]
    assert (
        contexts.sort_values(order)
        .reset_index(drop=True)
        .equals(examples.sort_values(order).reset_index(drop=True))
    )
    assert (contexts.kind == "top").any()

    tensors, _ = read_sae(sae)
    ds = open_dataset(plan.dataset)
    x = torch.cat([torch.as_tensor(np.asarray(ds.shard_view(s, "activation"), np.float32))
                   for s in range(len(ds.paths))])  # fmt: skip
    pre = (x - tensors["decoder_bias"]) @ tensors["encoder_weight"].T + tensors["encoder_bias"]
    z = pre * (pre > tensors["threshold"])
    fires = z > 0
    assert got["count"].tolist() == fires.sum(0).tolist()
    np.testing.assert_allclose(got["max"], z.max(0).values.clamp_min(0).numpy(), rtol=1e-5)
    per_token = fires.sum(1)
    assert per_token.min() < per_token.max() and per_token.max() > 8  # no fixed k
    assert summary.l0 == pytest.approx(float(per_token.double().mean()))
    assert summary.tokens == len(x) and 0 < got["dead"].sum() < len(got)


def test_bad_inputs_are_one_line_errors(run, extraction, make_sae, tmp_path):
    config, _ = run
    from pyspark_safetensors.sae import read_sae, save_sae

    narrow = make_sae(tmp_path / "narrow.safetensors", width=128)
    no_k = tmp_path / "no-k.safetensors"  # a TopK SAE (the default) that records no k
    save_sae(no_k, read_sae(config.sae)[0], {"hook_point": "encoder.layer.0:output"})
    no_texts = tmp_path / "no-texts"
    no_texts.mkdir()
    for entry in extraction.iterdir():
        if entry.name != "texts.jsonl":
            os.symlink(entry, no_texts / entry.name)
    cases = {
        "width 128": {"sae": str(narrow)},
        "encoder.layer.3:output": {"hook": "encoder.layer.3:output"},
        "texts.jsonl": {"extraction": str(no_texts)},
        "records no k": {"sae": str(no_k)},
    }
    for needle, change in cases.items():
        bad = FeaturesConfig(**{**config.to_dict(), **change, "out": str(tmp_path / "o")})
        with pytest.raises(FeaturesError) as e:
            plan_features(bad)
        assert needle in str(e.value) and "\n" not in str(e.value)
        assert isinstance(e.value, ValueError)
    assert not (tmp_path / "o").exists()


def test_an_existing_output_is_kept_without_overwrite(spark, run):
    config, summary = run
    before = sorted(p.name for p in summary.out.iterdir())
    with pytest.raises(FeaturesError, match="overwrite"):
        run_features(spark, FeaturesConfig(**{**config.to_dict(), "overwrite": False}))
    assert sorted(p.name for p in summary.out.iterdir()) == before


def test_the_browser_in_headless_chromium(run, repo_root):
    from pyspark_safetensors.features.screenshot import chromium, chromium_missing

    missing = chromium_missing()
    if missing:
        pytest.skip(f"no headless Chromium: {missing}")
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    _, summary = run
    with chromium() as driver:
        driver.get((summary.out / "index.html").resolve().as_uri())
        rows = driver.find_elements(By.CSS_SELECTOR, "tr.latent-row")
        assert len(rows) == LATENTS
        freq_order = [r.get_attribute("data-latent") for r in rows]
        driver.find_element(By.ID, "sort-max").click()
        rows = driver.find_elements(By.CSS_SELECTOR, "tr.latent-row")
        max_order = [r.get_attribute("data-latent") for r in rows]
        assert max_order != freq_order
        maxima = [float(r.find_elements(By.TAG_NAME, "td")[2].text) for r in rows]
        assert maxima == sorted(maxima, reverse=True)
        assert driver.find_elements(By.CSS_SELECTOR, "span.badge.dead")
        rows[0].click()
        WebDriverWait(driver, 10).until(lambda d: d.find_elements(By.CSS_SELECTOR, ".context"))
        spans = driver.find_elements(By.CSS_SELECTOR, ".context .tok")
        shading = {}
        for span in spans[:200]:
            shading.setdefault(
                float(span.get_attribute("data-act")),
                span.value_of_css_property("background-color"),
            )
        peak, low = max(shading), min(shading)
        assert peak > low and shading[peak] != shading[low]
        assert len(set(shading.values())) > 2  # the shade follows the activation
        png = repo_root / "docs" / "img" / "feature-browser.png"
        png.parent.mkdir(parents=True, exist_ok=True)
        assert driver.save_screenshot(str(png)) and png.stat().st_size > 10_000
        token = driver.find_elements(By.CSS_SELECTOR, "tr.latent-row td.toks")[0].text.split()[0]
        search = driver.find_element(By.ID, "search")
        search.send_keys(token)
        rows = driver.find_elements(By.CSS_SELECTOR, "tr.latent-row")
        assert 0 < len(rows) < LATENTS
        assert all(token.lower() in r.find_elements(By.TAG_NAME, "td")[4].get_attribute("textContent").lower()
                   for r in rows)  # fmt: skip
        search.send_keys("zzzz-no-such-token")
        assert not driver.find_elements(By.CSS_SELECTOR, "tr.latent-row")
