"""The research pipeline on images, through the real CLI: the tiny toy ViT trained as the
pipeline's first stage, its image set drawn, the extraction in Spark (our datasets and a
saev dump), an SAE on the patches and one on the CLS token trained from the dump, the
classifier's loss with each spliced in, the image-patch feature browser with its ground
truth, and the report."""

import json
import math
import os
import subprocess
import sys

import pytest

from pyspark_safetensors.interop.saev import open_saev

pytestmark = pytest.mark.integration

HOOK = "vit.layers.0:output"  # the patches still feed the CLS token after it
CONFIG = f"""
[pipeline]
model = "toy-vit"
images = 96
held_out_images = 48
master = "local[1]"
nproc = 1
epochs = 4
features = true
features_top_n = 4
[pipeline.hooks]
"{HOOK}" = []
[toy_vit]
preset = "tiny"
[sae]
expansion_factor = 4
k = 4
batch_size = 128
log_every = 2
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    work = tmp_path_factory.mktemp("pipeline-vit")
    (work / "vit.toml").write_text(CONFIG)
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable}
    result = subprocess.run(
        [sys.executable, "-m", "pyspark_safetensors.cli", "pipeline", "--config", "vit.toml",
         "--out", "run"],
        cwd=work, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return work / "run"


def test_the_stages_and_the_saev_dump(run):
    summary = json.loads((run / "summary.json").read_text())
    assert set(summary["stages"]) == {
        "model", "images", "extract", "evaluation", "sae-vit_layers_0_output",
        "sae-vit_layers_0_output-cls", "features-vit_layers_0_output",
        "features-vit_layers_0_output-cls",
    }  # fmt: skip
    assert summary["extraction"]["modality"] == "image" and summary["extraction"]["texts"] == 96
    tokens = summary["toy_vit"]["config"]["image_size"] ** 2 // 64 + 1  # patches of 8, and CLS
    assert summary["extraction"]["tokens"] == 96 * tokens
    patches = open_saev(run / "extract" / "data" / "saev", patches="image", layer=0)
    cls = open_saev(run / "extract" / "data" / "saev", patches="cls", layer=0)
    assert len(patches) == 96 * (tokens - 1) and len(cls) == 96


def test_the_classifier_figures_of_each_sae(run):
    summary = json.loads((run / "summary.json").read_text())
    ev = summary["evaluation"]
    assert ev["held_out_images"] == 48
    assert set(ev["sae"]) == {HOOK, f"{HOOK} (CLS)"}
    for figures in ev["sae"].values():
        assert 0 < figures["fvu"] < 1.5 and 0 < figures["l0"] <= 4
    cl = ev["classifier"]
    assert cl["images"] == 48 and 0 <= cl["accuracy_clean"] <= 1
    for name, h in cl["saes"].items():
        assert h["tokens"] == ("cls" if name.endswith("(CLS)") else "image")
        assert all(math.isfinite(h[k]) for k in ("ce_spliced", "ce_zero_ablated", "kl_spliced"))
        assert h["kl_zero_ablated"] > 0  # the tokens matter to the classifier
        if h["ce_zero_ablated"] != cl["ce_clean"]:
            assert h["loss_recovered"] == pytest.approx(
                (h["ce_zero_ablated"] - h["ce_spliced"]) / (h["ce_zero_ablated"] - cl["ce_clean"])
            )


def test_the_feature_browser_has_ground_truth_and_the_report_shows_it(run):
    summary = json.loads((run / "summary.json").read_text())
    f = summary["features"][HOOK]
    assert f["modality"] == "image"
    factors = {row["factor"] for row in f["ground_truth"]}
    assert {"shape", "colour"} <= factors
    assert all(0 <= row["auroc"] <= 1 for row in f["ground_truth"])
    assert (run / f["dir"] / "features" / "index.html").is_file()
    cls = summary["features"][f"{HOOK} (CLS)"]  # its statistics over the CLS tokens alone
    assert cls["tokens"] == 96 and not cls["ground_truth"]
    report = (run / "report.md").read_text()
    assert "## Classifier with the SAEs spliced in" in report and "toy ViT" in report
    assert f"Ground truth of `{HOOK}`" in report
    assert "## Language-model loss" not in report and "## LUT layers" not in report


def test_every_sae_is_probed_on_the_image_factors(run):
    """SAEBench's sparse probing of each SAE on the held-out images' factors, a task per
    factor value (or named as left out), beside the raw activations, in the report."""
    import pyarrow.parquet as pq

    summary = json.loads((run / "summary.json").read_text())
    pr = summary["evaluation"]["probing"]
    assert pr["images"] == 48 and pr["train_images"] == 24 and pr["tasks"]
    labels = pq.read_table(run / summary["stages"]["images"]["dir"] / "held_out" / "labels.parquet")
    values = {f"{f}={v}" for f in ("shape", "colour", "texture", "size", "background")
              for v in labels.column(f).to_pylist()}  # fmt: skip
    assert set(pr["tasks"]) | set(pr["skipped"]) == values
    assert set(pr["saes"]) == {HOOK, f"{HOOK} (CLS)"}
    for r in pr["saes"].values():
        for side in ("sae", "activations"):
            assert set(r[side]["tasks"]) == set(pr["tasks"])
            assert all(0 <= r[side][k] <= 1 for k in ("top_1", "top_2", "top_5", "full"))
    report = (run / "report.md").read_text()
    assert (
        "## Sparse probing of the image factors" in report
        and "| SAE | tokens | SAE top-1" in report
    )
