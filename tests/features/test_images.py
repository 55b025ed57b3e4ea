"""The feature job on an image extraction (made in the test, in the contract's layout:
``image_set.py``): its tables equal the single-process reference's, each example holds
the latent's activation on every token of its image (the heat map), the top examples are
distinct images, the thumbnails come from ``images.parquet``, the ground truth finds the
latents that read each factor, and the browser draws it all in headless Chromium."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from image_set import GRID, REGISTERS, TOKENS, direction_sae, write_image_extraction
from tables import assert_examples_match, assert_latents_match

from pyspark_safetensors.features import FeaturesConfig, FeaturesError, plan_features, run_features
from pyspark_safetensors.features.ground_truth import auroc_dense, factor_masks
from pyspark_safetensors.features.merge import examples_table, latents_table
from pyspark_safetensors.features.reference import reference_state

pytestmark = pytest.mark.spark
CIRCLE, SQUARE, RED, BLUE, CLS = 0, 1, 2, 3, 4  # image_set.DIRECTIONS


@pytest.fixture(scope="module")
def image_run(spark, tmp_path_factory):
    root = tmp_path_factory.mktemp("image-features")
    factors = write_image_extraction(root / "acts")
    sae = direction_sae(root / "sae.safetensors")
    config = FeaturesConfig(
        extraction=str(root / "acts"), sae=str(sae), out=str(root / "features"), top_n=5,
        samples_per_band=2, batch_tokens=50, factors=str(root / "acts" / "factors.parquet"),
    )  # fmt: skip
    return config, run_features(spark, config), factors


def dense_code(plan):
    """Every token's activation of every latent, ``[images, TOKENS, latents]``."""
    import torch

    from pyspark_safetensors.sae.ecosystem import load_sae_model
    from pyspark_safetensors.torch import open_dataset

    ds = open_dataset(plan.dataset)
    x = np.concatenate([np.asarray(ds.shard_view(s, "activation"), np.float32)
                        for s in range(len(ds.paths))])  # fmt: skip
    with torch.inference_mode():
        values, indices = load_sae_model(plan.sae).encode(torch.from_numpy(x))
    z = torch.zeros(len(x), plan.n_latents).scatter_(1, indices.long(), values.float())
    return z.numpy().reshape(-1, TOKENS, plan.n_latents)


def test_tables_equal_the_reference_and_hold_whole_images(image_run):
    config, summary, _ = image_run
    plan = plan_features(config)
    assert plan.layout.tokens == TOKENS and summary.modality == "image"
    state = reference_state(plan, config)
    assert summary.tokens == state.tokens == 24 * TOKENS
    got = pq.read_table(summary.out / "latents.parquet").to_pandas().sort_values("latent")
    assert_latents_match(got, latents_table(state, config).to_pandas())
    contexts = pq.read_table(summary.out / "contexts.parquet").to_pandas()
    examples = examples_table(state, config).to_pandas()
    assert_examples_match(contexts.assign(sample_id=contexts.image_id.astype(np.int64),
                                          window=np.int32(0)), examples)  # fmt: skip
    z = dense_code(plan)
    for r in contexts.itertuples():  # the heat map: the latent on every token of the image
        np.testing.assert_allclose(r.acts, z[r.image_id, :, r.latent], rtol=1e-5, atol=1e-6)
        assert r.acts[r.token_pos] == pytest.approx(r.value, rel=1e-5)
        patch = r.token_pos - 1 - REGISTERS
        kind = "cls" if r.token_pos == 0 else "register" if patch < 0 else "patch"
        assert r.token_kind == kind
        assert (r.patch_row, r.patch_col) == (
            (patch // GRID, patch % GRID) if patch >= 0 else (-1, -1)
        )
    top = contexts[contexts.kind == "top"]
    assert not top.duplicated(["latent", "image_id"]).any()  # distinct images
    for latent, rows in top.groupby("latent"):  # each image by its largest token, best first
        best = z[:, :, latent].max(1)
        want = np.lexsort((np.arange(len(best)), -best))[: config.top_n]
        assert rows.sort_values("rank").image_id.tolist() == [i for i in want if best[i] > 0]
    assert set(contexts[contexts.latent == CLS].token_kind) == {"cls"}
    assert set(contexts[contexts.latent == CIRCLE].kind) > {"top"}


def test_thumbnails_and_the_outputs(image_run):
    config, summary, _ = image_run
    contexts = pq.read_table(summary.out / "contexts.parquet")
    images = pq.read_table(f"{config.extraction}/images.parquet").to_pandas().set_index("image_id")
    shown = set(contexts.column("image_id").to_pylist())
    pngs = {int(p.stem): p.read_bytes() for p in (summary.out / "data" / "img").iterdir()}
    assert set(pngs) == shown and len(shown) > 5
    assert all(pngs[i] == images.thumbnail[i] for i in shown)
    doc = json.loads((summary.out / "features.json").read_text())
    assert "ground_truth.parquet/part-00000.parquet" in doc["files"]
    assert doc["summary"]["modality"] == "image"


def test_ground_truth_finds_the_latent_of_each_factor(image_run):
    config, summary, factors = image_run
    truth = pq.read_table(summary.out / "ground_truth.parquet").to_pandas()
    best = {(r.factor, r.value): r for r in truth.itertuples()}
    want = {("shape", "circle"): CIRCLE, ("shape", "square"): SQUARE, ("colour", "red"): RED,
            ("colour", "blue"): BLUE}  # fmt: skip
    assert {k: r.latent for k, r in best.items()} == want
    assert all(r.auroc >= 0.99 for r in best.values())
    assert summary.ground_truth == truth.to_dict("records")
    z = dense_code(plan_features(config))  # the AUROC of every latent, computed directly
    image = factors.column("image_id").to_numpy()
    pos = 1 + REGISTERS + factors.column("patch_row").to_numpy() * GRID + factors.column(
        "patch_col").to_numpy()  # fmt: skip
    codes = z[image, pos]
    for key, inside in factor_masks(factors).items():
        scores = auroc_dense(codes, inside)
        assert best[key].auroc == pytest.approx(scores.max(), abs=1e-9)
        assert best[key].second_auroc == pytest.approx(np.sort(scores)[-2], abs=1e-9)
        assert best[key].positives == inside.sum()


def test_factor_tables_it_refuses(image_run, tmp_path):
    import pyarrow as pa

    config, _, factors = image_run
    outside = factors.set_column(1, "patch_row", pa.array(np.full(len(factors), GRID)))
    unknown = factors.set_column(0, "image_id", pa.array(np.full(len(factors), 999)))
    for needle, table in {"outside the 4x4": outside, "labelled twice": unknown}.items():
        pq.write_table(table, tmp_path / "f.parquet")
        bad = FeaturesConfig(**{**config.to_dict(), "factors": str(tmp_path / "f.parquet"),
                                "out": str(tmp_path / "o")})  # fmt: skip
        from pyspark_safetensors.features.ground_truth import read_factors

        with pytest.raises(FeaturesError, match=needle):
            read_factors(bad.factors, plan_features(bad).layout)


def test_the_image_browser_in_headless_chromium(image_run, tmp_path):
    from pyspark_safetensors.features.screenshot import chromium, chromium_missing

    missing = chromium_missing()
    if missing:
        pytest.skip(f"no headless Chromium: {missing}")
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    config, summary, _ = image_run
    with chromium(1400, 1000) as driver:
        driver.get((summary.out / "index.html").resolve().as_uri())
        truth = driver.find_elements(By.CSS_SELECTOR, "#truth tr.truth-row")  # shown first
        assert [r.get_attribute("data-latent") for r in truth] == ["0", "1", "3", "2"]
        assert "shape" in truth[0].text and "1.00" in truth[0].text
        truth[0].find_element(By.TAG_NAME, "a").click()  # the detector of circles
        WebDriverWait(driver, 10).until(lambda d: d.find_elements(By.CSS_SELECTOR, ".tile"))
        assert (
            "best latent for shape = circle"
            in driver.find_element(By.CSS_SELECTOR, ".detects").text
        )
        tops = driver.find_elements(By.CSS_SELECTOR, '.tiles[data-kind="top"] .tile')
        assert len(tops) == config.top_n
        assert all("circle" in t.find_element(By.CLASS_NAME, "caption").text for t in tops)
        cells = tops[0].find_elements(By.CSS_SELECTOR, ".cell")
        assert len(cells) == GRID * GRID
        colours = {float(c.get_attribute("data-act")): c.value_of_css_property("background-color")
                   for c in cells}  # fmt: skip
        assert colours[0.0].endswith(", 0)") and len(set(colours.values())) > 2
        assert len(tops[0].find_elements(By.CSS_SELECTOR, ".cell.center")) == 1
        assert driver.execute_script(
            "return [...document.querySelectorAll('.tile img')].every(i => i.naturalWidth > 0)"
        )
        png = tmp_path / "browser.png"  # the docs' screenshot is the toy ViT's (test_toy_vit)
        assert driver.save_screenshot(str(png)) and png.stat().st_size > 10_000
        driver.find_element(By.CSS_SELECTOR, f'tr.latent-row[data-latent="{CLS}"]').click()
        WebDriverWait(driver, 10).until(lambda d: d.find_elements(By.CSS_SELECTOR, ".marker"))
        marked = driver.find_elements(By.CSS_SELECTOR, '.tiles[data-kind="top"] .frame.whole')
        assert len(marked) == config.top_n  # CLS examples: the whole image, marked
        driver.find_element(By.ID, "show-overview").click()  # saev's distributions
        charts = driver.find_elements(By.CSS_SELECTOR, "#detail svg.overview-hist")
        assert len(charts) == 2
        for chart in charts:  # every live latent counted once
            titles = [
                t.get_attribute("textContent") for t in chart.find_elements(By.TAG_NAME, "title")
            ]
            assert sum(int(t.rsplit(": ", 1)[1]) for t in titles) == 12
        search = driver.find_element(By.ID, "search")
        search.send_keys("square")
        rows = driver.find_elements(By.CSS_SELECTOR, "tr.latent-row")
        assert 0 < len(rows) < 12 and all("square" in r.text for r in rows)


def test_images_out_of_token_order_give_the_same_contexts(spark, image_run, tmp_path):
    """Rows shuffled: the second pass re-encodes the example images, each window the
    whole image again; the tables and the ground truth are the same."""
    import os
    import shutil

    from pyspark.sql import functions as F

    config, summary, _ = image_run
    shuffled = tmp_path / "shuffled"
    shutil.copytree(config.extraction, shuffled, ignore=shutil.ignore_patterns("activations"))
    plan = plan_features(config)
    dataset = os.path.relpath(plan.dataset, config.extraction)
    spark.read.format("safetensors").load(plan.dataset).orderBy(F.rand(seed=1)).write.format(
        "safetensors"
    ).option("batch_size", 64).mode("overwrite").save(str(shuffled / dataset))
    out = tmp_path / "features"
    again = run_features(spark, dataclasses.replace(
        config, extraction=str(shuffled), out=str(out),
        factors=str(shuffled / "factors.parquet")))  # fmt: skip
    assert again.second_pass and not summary.second_pass
    got = pq.read_table(out / "contexts.parquet").to_pandas()
    want = pq.read_table(summary.out / "contexts.parquet").to_pandas()
    assert got.drop(columns=["acts", "value"]).equals(want.drop(columns=["acts", "value"]))
    for a, b in zip(got.acts, want.acts, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert again.ground_truth == summary.ground_truth


def test_a_layout_the_tokens_do_not_follow_is_refused(image_run, tmp_path):
    import os

    config, _, _ = image_run
    bad = tmp_path / "acts"
    bad.mkdir()
    for entry in os.scandir(config.extraction):
        if entry.name != "extraction.json":
            os.symlink(entry.path, bad / entry.name)
    doc = json.loads((Path(config.extraction) / "extraction.json").read_text())
    for change, needle in (({"n_registers": 0}, "layout"), ({"patch_grid": None}, "patch_grid")):
        (bad / "extraction.json").write_text(json.dumps({**doc, **change}))
        with pytest.raises(FeaturesError, match=needle) as e:
            plan_features(dataclasses.replace(config, extraction=str(bad)))
        assert "\n" not in str(e.value)
    text = dataclasses.replace(config, extraction=str(bad), factors="x.parquet")
    (bad / "extraction.json").write_text(json.dumps({**doc, "modality": "text"}))
    with pytest.raises(FeaturesError, match="not an image extraction"):
        plan_features(text)


def test_token_kinds_choose_the_tokens_studied(spark, image_run, tmp_path):
    """``token_kinds=("cls",)``: only the CLS tokens enter the statistics and the
    examples (an SAE of the CLS token), in the job as in the reference; the examples'
    heat maps still hold every token of their image. ``("patch",)`` in the reference:
    the patches only."""
    config, _, _ = image_run
    cls = dataclasses.replace(config, token_kinds=("cls",), factors="",
                              out=str(tmp_path / "cls"))  # fmt: skip
    summary = run_features(spark, cls)
    plan = plan_features(cls)
    z = dense_code(plan)
    assert summary.tokens == len(z)
    got = pq.read_table(summary.out / "latents.parquet").to_pandas().sort_values("latent")
    assert got["count"].tolist() == (z[:, 0] > 0).sum(0).tolist()
    assert_latents_match(got, latents_table(reference_state(plan, cls), cls).to_pandas())
    contexts = pq.read_table(summary.out / "contexts.parquet").to_pandas()
    assert set(contexts.token_kind) == {"cls"} and set(contexts.token_pos) == {0}
    for r in contexts.itertuples():
        np.testing.assert_allclose(r.acts, z[r.image_id, :, r.latent], rtol=1e-5, atol=1e-6)
    patches = dataclasses.replace(cls, token_kinds=("patch",))
    state = reference_state(plan_features(patches), patches)
    assert state.tokens == len(z) * GRID * GRID
    counts = latents_table(state, patches).column("count").to_pylist()
    assert counts == (z[:, 1 + REGISTERS :] > 0).sum((0, 1)).tolist()
    with pytest.raises(FeaturesError, match="token_kinds"):
        FeaturesConfig(token_kinds=("patches",))
