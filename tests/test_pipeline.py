"""The research pipeline through the real CLI on a tiny config: Spark extraction of two
hook points, two SAEs trained by torchrun with 2 processes, LUTs, held-out evaluation,
a feature browser per SAE, the report; a rerun reuses every stage; a foreign output
directory is refused."""

import json
import os
import subprocess
import sys

import pytest

from pyspark_safetensors.dataset import verify_dataset
from pyspark_safetensors.lut import validate_lut
from pyspark_safetensors.sae import load_sae

pytestmark = pytest.mark.integration

TINY = """
[pipeline]
texts = 24
held_out_texts = 6
max_length = 48
master = "local[2]"
nproc = 2
epochs = 2
ms = [0, 8]
[sae]
expansion_factor = 2
k = 8
batch_size = 256
log_every = 2
"""
HOOKS = ["encoder.layer.0.attention.self.query:input", "encoder.layer.0.intermediate.dense:input"]


def cli(*args, cwd):
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable}
    return subprocess.run(
        [sys.executable, "-m", "pyspark_safetensors.cli", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    work = tmp_path_factory.mktemp("pipeline")
    (work / "tiny.toml").write_text(TINY)
    result = cli("pipeline", "--config", "tiny.toml", "--out", "run", cwd=work)
    assert result.returncode == 0, result.stderr[-3000:]
    return work


def test_every_artifact_exists_and_validates(run):
    summary = json.loads((run / "run" / "summary.json").read_text())
    stages = summary["stages"]
    slugs = [h.replace(":", ".").replace(".", "_") for h in HOOKS]
    assert set(stages) == {"extract", "lut", "evaluation"} | {
        f"{stage}-{slug}" for stage in ("sae", "features") for slug in slugs
    }
    for name, stage in stages.items():  # stable names point at the current outputs
        assert (run / "run" / name).resolve() == (run / "run" / stage["dir"]).resolve()
    extract = run / "run" / stages["extract"]["dir"] / "data"
    for hook in HOOKS:
        m = verify_dataset(extract / "activations" / hook.replace(":", ".").replace(".", "_"))
        assert m.total_samples == summary["extraction"]["tokens"]
    meta = validate_lut(run / "run" / stages["lut"]["dir"] / "lut")
    assert len(meta["layers"]) == 4
    assert meta["creation_info"]["source_model"] == summary["source_model"]
    for hook, run_dir in summary["sae_runs"].items():
        tensors, sae_meta = load_sae(run / "run" / run_dir / "sae.safetensors")
        assert tensors["encoder_weight"].shape == (768, 384)
        assert sae_meta["hook_point"] == hook
        assert (run / "run" / run_dir / "training.png").stat().st_size > 10_000
    evaluation = run / "run" / summary["evaluation_dir"]
    for png in ("latent_frequency.png", "evaluation.png"):
        assert (evaluation / png).stat().st_size > 10_000
    assert sorted(summary["features"]) == sorted(HOOKS)
    for features in summary["features"].values():  # every latent of every SAE
        browser = run / "run" / features["dir"] / "features"
        assert features["latents"] == 768 and features["tokens"] == summary["extraction"]["tokens"]
        assert (browser / "index.html").is_file() and (browser / "data" / "latents.js").is_file()
        assert (browser / "latents.parquet").is_dir() and (browser / "contexts.parquet").is_dir()


def test_report_and_summary_hold_every_figure(run):
    summary = json.loads((run / "run" / "summary.json").read_text())
    ev = summary["evaluation"]
    for hook in HOOKS:
        train, held = summary["training"][hook], ev["sae"][hook]
        assert 0 < train["fvu"] < 1.5 and 0 < held["fvu"] < 1.5
        assert held["l0"] == pytest.approx(8, abs=1e-6)
        assert 0 <= held["dead_fraction"] <= 1 and held["tokens"] == ev["held_out_tokens"][hook]
    assert {r["layer"] for r in ev["lut"]} == {
        f"encoder.layer.0.attention.self.{p}" for p in ("query", "key", "value")
    } | {"encoder.layer.0.intermediate.dense"}
    assert {r["m"] for r in ev["lut"]} == {0, 8} and 8 in {r["k"] for r in ev["lut"]}
    assert all(t["lut_ms"] > 0 and t["dense_ms"] > 0 for t in ev["latency"].values())
    assert set(ev["embedding_cosine"]) == {"0", "8"}
    assert all(0 < c <= 1.0001 for c in ev["embedding_cosine"].values())
    report = (run / "run" / "report.md").read_text()
    for needle in ("FVU (held-out)", "LUT / dense", "Sentence embeddings", "**k=8**", HOOKS[1],
                   "## Feature browsers", "/features/index.html"):  # fmt: skip
        assert needle in report
    for line in report.splitlines():  # every picture the report shows exists
        if line.startswith("![") or line.startswith("- `"):
            assert (run / "run" / line.split("](")[1].split(")")[0]).is_file(), line


def test_rerun_reuses_every_stage(run):
    before = json.loads((run / "run" / "summary.json").read_text())
    result = cli("pipeline", "--config", "tiny.toml", "--out", "run", cwd=run)
    assert result.returncode == 0, result.stderr[-3000:]
    after = json.loads((run / "run" / "summary.json").read_text())
    assert all(s["reused"] for s in after["stages"].values())
    assert {n: s["dir"] for n, s in after["stages"].items()} == {
        n: s["dir"] for n, s in before["stages"].items()
    }
    assert after["evaluation"] == before["evaluation"]


def test_foreign_output_directory_is_refused_and_untouched(tmp_path):
    (tmp_path / "tiny.toml").write_text(TINY)
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    result = cli("pipeline", "--config", "tiny.toml", "--out", "mine", cwd=tmp_path)
    assert result.returncode == 2
    assert "not empty and was not created by the pipeline" in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]
    assert (foreign / "notes.txt").read_text() == "keep me"


def test_stages_built_together_keep_the_finished_ones_when_one_fails(tmp_path):
    # the train stage's way: one launch builds every SAE, a failure keeps those before it
    from pyspark_safetensors.pipeline.run import Pipeline, PipelineConfig

    pipeline = Pipeline(PipelineConfig(out=str(tmp_path / "out")), log=lambda *_: None)
    keys = {"sae-a": "1", "sae-b": "2"}

    def finished(directory):
        return (directory / "sae.safetensors").is_file()

    def fails_on_the_second(tmp):
        (tmp["sae-a"] / "sae.safetensors").write_bytes(b"a finished run")
        (tmp["sae-b"] / "metrics.jsonl").write_text("{}\n")
        raise RuntimeError("the second run failed")

    with pytest.raises(RuntimeError, match="the second run failed"):
        pipeline.stages(keys, fails_on_the_second, finished=finished)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["sae-a-1"]  # no staging

    built = []
    paths = pipeline.stages(keys, lambda tmp: built.extend(tmp), finished=finished)
    assert built == ["sae-b"]  # the kept one is reused
    assert (paths["sae-a"] / "sae.safetensors").read_bytes() == b"a finished run"
    assert paths["sae-b"].is_dir() and (tmp_path / "out" / "sae-b").resolve() == paths["sae-b"]
    assert [pipeline.summary["stages"][n]["reused"] for n in keys] == [True, False]
