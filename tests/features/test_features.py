"""The feature job in Spark on a tiny extraction: its statistics and examples equal the
single-process reference's, its contexts hold the latent's activation on every token,
its outputs are published whole, bad inputs stop it with one line, and the browser
works in a real (headless) Chromium. A crosscoder over two row-aligned datasets of the
extraction's tokens: its browser shows the code of their rows concatenated, and a
misaligned pair is refused naming both."""

from __future__ import annotations

import dataclasses
import json
import os
import re

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from tables import assert_examples_match, assert_latents_match

from conftest import HOOK, WIDTH, K
from pyspark_safetensors.dataset import write_batch_dataset
from pyspark_safetensors.features import FeaturesConfig, FeaturesError, plan_features, run_features
from pyspark_safetensors.features.merge import examples_table, latents_table
from pyspark_safetensors.features.reference import reference_contexts, reference_state
from pyspark_safetensors.torch import open_dataset
from pyspark_safetensors.torch.loader import MisalignedDatasetsError

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
    from pyspark_safetensors.sae.ecosystem import load_sae_model

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
    from pyspark_safetensors.sae import read_sae

    sae = make_jumprelu(tmp_path / "saelens")
    assert "k" not in json.loads((sae / "cfg.json").read_text())
    # one torch thread in the workers and here: a JumpReLU's code is the exact bits of each
    # pre-activation against its threshold, and on the suite's reproducible MKL path a
    # GEMM's bits depend on the thread count (tests/cpu_path.py)
    config = FeaturesConfig(
        extraction=str(extraction), sae=str(sae), out=str(tmp_path / "features"), top_n=5,
        context=3, samples_per_band=2, batch_tokens=128, threads=1,
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


def test_the_browser_in_headless_chromium(run, tmp_path):
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
        # the suite never writes into the repository: docs/img/ holds a copy made by hand
        png = tmp_path / "feature-browser.png"
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


# -- a crosscoder: two row-aligned datasets of the extraction's tokens ------------------

LAYER_B = "toy.layer_b:output"  # not in the extraction: the checkpoint's datasets are read
COLUMNS = ("activation", "sample_id", "window", "token_pos")
ROWS_PER_SHARD = 200  # rows 64..135 of a shard are not among those checked on opening


def write_layer(root, columns: dict, activation, order=None) -> str:
    """A dataset of the extraction's tokens (``order``: its rows in that order) with
    ``activation`` as its rows, in shards of ``ROWS_PER_SHARD``."""
    order = np.arange(len(activation)) if order is None else order
    cols = {**{c: columns[c][order] for c in COLUMNS[1:]}, "activation": activation[order]}
    write_batch_dataset(root, cols, rows_per_shard=ROWS_PER_SHARD)
    return str(root)


@pytest.fixture(scope="module")
def layers(extraction, tmp_path_factory):
    """The extraction's hook point re-written (``a``) and a second layer of the same
    tokens (``b``: a fixed random map of ``a``), the two concatenated (``x``), and the
    same pair with its rows shuffled alike (``a_shuffled``, ``b_shuffled``)."""
    root = tmp_path_factory.mktemp("layers")
    doc = json.loads((extraction / "extraction.json").read_text())
    ds = open_dataset(extraction / doc["hooks"][HOOK]["dataset"])
    columns = {c: np.concatenate([np.asarray(ds.shard_view(s, c)).reshape(ds.counts[s], -1)
                                  for s in range(len(ds.paths))]) for c in COLUMNS}  # fmt: skip
    columns = {c: v if c == "activation" else v[:, 0] for c, v in columns.items()}
    a = columns["activation"].astype(np.float32)
    mix = np.random.default_rng(3).standard_normal((WIDTH, WIDTH)).astype(np.float32)
    b = np.tanh(a @ mix / np.sqrt(WIDTH)) * 4.0
    order = np.random.default_rng(4).permutation(len(a))
    return {
        "a": write_layer(root / "a", columns, a), "b": write_layer(root / "b", columns, b),
        "a_shuffled": write_layer(root / "a-shuffled", columns, a, order),
        "b_shuffled": write_layer(root / "b-shuffled", columns, b, order),
        "x": np.concatenate([a, b], axis=1), "columns": columns, "root": root,
    }  # fmt: skip


@pytest.fixture(scope="module")
def crosscoder(layers):
    """A random TopK crosscoder over (a, b) whose training config names those datasets."""
    from pyspark_safetensors.sae import save_sae

    gen = torch.Generator().manual_seed(5)
    w = torch.nn.functional.normalize(torch.randn(LATENTS, 2 * WIDTH, generator=gen), dim=1)
    tensors = {"encoder_weight": w, "encoder_bias": -torch.rand(LATENTS, generator=gen),
               "decoder_weight": w.clone(), "decoder_bias": torch.zeros(2 * WIDTH)}  # fmt: skip
    path = layers["root"] / "crosscoder.safetensors"
    save_sae(path, tensors, {
        "architecture": "crosscoder", "k": str(K), "blocks": "2", "hook_points": [HOOK, LAYER_B],
        "config": {"architecture": "crosscoder", "datasets": [layers["a"], layers["b"]]},
    })  # fmt: skip
    return path


@pytest.fixture(scope="module")
def crosscoder_run(spark, extraction, crosscoder, tmp_path_factory):
    out = tmp_path_factory.mktemp("crosscoder-out") / "features"
    config = FeaturesConfig(extraction=str(extraction), sae=str(crosscoder), out=str(out),
                            top_n=5, context=3, samples_per_band=2, batch_tokens=128)  # fmt: skip
    return config, run_features(spark, config)


def test_the_browser_shows_the_code_of_the_concatenated_rows(crosscoder_run, layers, crosscoder):
    """Every latent's count and top examples equal the crosscoder's code of each token's
    rows of both datasets, concatenated in its order and encoded at once here; the
    datasets came from the checkpoint's config, the texts from the extraction."""
    from pyspark_safetensors.sae.ecosystem import load_sae_model

    config, summary = crosscoder_run
    plan = plan_features(config)
    assert plan.inputs == (layers["a"], layers["b"]) and plan.dataset == layers["a"]
    assert summary.hook == f"{HOOK} + {LAYER_B}" and summary.tokens == len(layers["x"])
    with torch.inference_mode():
        values, indices = load_sae_model(crosscoder).encode(torch.from_numpy(layers["x"]))
    z = torch.zeros(len(values), LATENTS).scatter_(1, indices.long(), values.float()).numpy()
    latents = pq.read_table(summary.out / "latents.parquet").to_pandas().sort_values("latent")
    assert latents["count"].tolist() == (z > 0).sum(0).tolist()
    contexts = pq.read_table(summary.out / "contexts.parquet").to_pandas()
    ids = layers["columns"]
    checked = 0
    for latent in range(LATENTS):
        rows = np.flatnonzero(z[:, latent] > 0)
        want = rows[np.argsort(-z[rows, latent], kind="stable")][: config.top_n]
        got = contexts[(contexts.kind == "top") & (contexts.latent == latent)].sort_values("rank")
        assert got["sample_id"].tolist() == ids["sample_id"][want].tolist()
        assert got["token_pos"].tolist() == ids["token_pos"][want].tolist()
        np.testing.assert_allclose(got["value"], z[want, latent], rtol=1e-5)
        checked += len(want)
    assert checked > 100
    assert all(len(t) and all(isinstance(s, str) for s in t) for t in contexts["tokens"])
    # the same state as the single-process loop over the pair
    state = reference_state(plan, config)
    assert_latents_match(latents, latents_table(state, config).to_pandas())
    assert_examples_match(contexts, examples_table(state, config).to_pandas())
    doc = json.loads((summary.out / "features.json").read_text())
    assert doc["architecture"] == "crosscoder" and doc["datasets"] == [layers["a"], layers["b"]]


def test_a_shuffled_pair_gives_the_same_contexts(spark, crosscoder_run, layers, tmp_path):
    """Both datasets' rows shuffled alike (still row-aligned, out of token order): the
    windows come from the second pass, each token's rows joined across the datasets."""
    config, summary = crosscoder_run
    out = tmp_path / "features"
    shuffled = dataclasses.replace(config, out=str(out),
                                   datasets=(layers["a_shuffled"], layers["b_shuffled"]))  # fmt: skip
    again = run_features(spark, shuffled)
    assert again.second_pass and not summary.second_pass and again.tokens == summary.tokens
    got = pq.read_table(out / "contexts.parquet").to_pandas()
    want = pq.read_table(summary.out / "contexts.parquet").to_pandas()
    for column in ("latent", "kind", "rank", "sample_id", "token_pos", "center"):
        assert got[column].tolist() == want[column].tolist(), column
    assert [list(t) for t in got["tokens"]] == [list(t) for t in want["tokens"]]
    for a, b in zip(got["acts"], want["acts"], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_misaligned_pair_is_refused_naming_both(spark, crosscoder_run, layers, tmp_path):
    """Rows that are not the same tokens in both datasets: refused on opening where the
    sampled rows show it (and on a different row count), else by the task that reads
    them; the message names both datasets and the row."""
    config, _ = crosscoder_run
    columns, root = layers["columns"], layers["root"]
    b = layers["x"][:, WIDTH:]
    swapped = {}
    for row in (10, 100):  # sampled on opening, then not (shard 0's middle)
        order = np.arange(len(b))
        order[[row, row + 1]] = order[[row + 1, row]]
        swapped[row] = write_layer(root / f"b-swapped-{row}", columns, b, order)
    short = root / "b-short"
    write_batch_dataset(short, {**{c: columns[c][:-5] for c in COLUMNS[1:]}, "activation": b[:-5]},
                        rows_per_shard=ROWS_PER_SHARD)  # fmt: skip
    for other, needle in ((swapped[10], "row 10 has"), (str(short), "rows in shards")):
        with pytest.raises(MisalignedDatasetsError, match=re.escape(needle)) as e:
            plan_features(dataclasses.replace(config, datasets=(layers["a"], other)))
        assert layers["a"] in str(e.value) and other in str(e.value)
    late = dataclasses.replace(
        config, datasets=(layers["a"], swapped[100]), out=str(tmp_path / "o")
    )
    plan = plan_features(late)  # the sample read on opening agrees
    with pytest.raises(MisalignedDatasetsError, match=r"row 100 has (sample_id|token_pos)"):
        reference_state(plan, late)
    message = re.escape(f"{layers['a']} and {swapped[100]} are not row-aligned: row 100 has")
    with pytest.raises(Exception, match=message):  # from the task, through Spark
        run_features(spark, late)
    assert not (tmp_path / "o").exists()


def test_crosscoder_options_are_refused_where_they_do_not_apply(
    crosscoder_run, layers, make_sae, tmp_path
):
    config, _ = crosscoder_run
    narrow = write_layer(tmp_path / "narrow", layers["columns"], layers["x"][:, :128])
    cases = {
        "datasets are a crosscoder's": {"sae": str(make_sae(tmp_path / "sae.safetensors")),
                                        "datasets": (layers["a"], layers["b"])},
        "reads several hook points": {"hook": HOOK},
        "1 dataset(s)": {"datasets": (layers["a"],)},
        "have rows of [[384], [128]]": {"datasets": (layers["a"], narrow)},
    }  # fmt: skip
    for needle, change in cases.items():
        with pytest.raises(FeaturesError) as e:
            plan_features(dataclasses.replace(config, **change))
        assert needle in str(e.value) and "\n" not in str(e.value)
