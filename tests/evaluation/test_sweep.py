"""A sweep (``evaluation/sweep.py``) of a tiny grid: four SAEs of 120 steps on a synthetic
dataset, evaluated in one Spark job; its results table is whole, its report and plots are
written (SAEBench's core figures among them), the Spark job's figures equal the same
evaluation in one process, a rerun reuses every stage, and a bad configuration is refused
before anything runs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pyspark_safetensors.cli import main
from pyspark_safetensors.evaluation import HierarchyConfig, SyntheticModelConfig
from pyspark_safetensors.evaluation.sweep import (
    CORE_FIGURES,
    SweepConfig,
    evaluate_in_loop,
    prepare_evaluation,
    run_sweep,
)
from pyspark_safetensors.format.errors import InvalidArgumentError

pytestmark = pytest.mark.spark

MODEL = SyntheticModelConfig(
    num_features=48, hidden_dim=16,
    hierarchy=HierarchyConfig(total_root_nodes=4, branching_factor=3, max_depth=1,
                              mutually_exclusive_portion=1.0),
)  # fmt: skip


@pytest.fixture(scope="module")
def sweep(spark, tmp_path_factory):
    config = SweepConfig(
        out=str(tmp_path_factory.mktemp("sweep")), model=MODEL, train_rows=2048,
        eval_rows=2048, rows_per_partition=2048, families=("topk", "batchtopk"), widths=(32,),
        ks=(3,), seeds=(0, 1), tokens=120 * 128, batch_size=128, probe_train_rows=1200,
        probe_test_rows=600, probe_tasks=3, probe_ks=(1, 2), progress=False, train_threads=1,
        sae={"checkpoints": 0},
    )  # fmt: skip
    return config, run_sweep(spark, config, log=lambda *_: None)


def test_the_results_table_report_and_plots_are_written(sweep):
    config, summary = sweep
    out = Path(summary["evaluation"])
    rows = pq.read_table(summary["results"]).to_pylist()
    assert [(r["family"], r["seed"]) for r in rows] == [
        ("topk", 0), ("topk", 1), ("batchtopk", 0), ("batchtopk", 1)]  # fmt: skip
    for r in rows:
        for key in ("mcc", "f1", "fvu", "sae_l0", "dead_latents", "probe_top_1", "probe_top_2",
                    "probe_full"):  # fmt: skip
            assert r[key] is not None and math.isfinite(r[key]), (r["name"], key)
        assert 0 < r["mcc"] <= 1 and 0 <= r["probe_top_1"] <= 1 and r["samples"] == 2048
        assert r["fvu"] == pytest.approx(1 - r["explained_variance"])
        for key, _, _ in CORE_FIGURES:  # SAEBench's core figures beside them
            assert r[key] is not None and math.isfinite(r[key]), (r["name"], key)
        assert 0 < r["frac_alive"] <= 1 and -1 <= r["average_max_decoder_cosine_sim"] <= 1
    assert all(0 < r["sae_l0"] <= 3 for r in rows if r["family"] == "topk")
    doc = json.loads((out / "results.json").read_text())
    assert len(doc["saes"]) == 4 and set(doc["baseline"]) == {"top_1", "top_2", "full", "tasks"}
    assert len(doc["probe_tasks"]) == 3 and doc["config"]["model"]["num_features"] == 48
    report = (out / "report.md").read_text()
    assert "| family | width | k | seeds | L0 | MCC |" in report
    assert "| topk | 32 | 3 | 2 |" in report and " ± " in report
    assert "## SAEBench's core figures" in report and "| family | width | k | cos sim |" in report
    for name in ("mcc", "f1", "fvu", "absorption", "probe-top-1"):
        png = out / f"pareto-{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"]({png.name})" in report
    assert (Path(config.out) / "eval").resolve() == out.resolve()


def test_the_spark_job_equals_the_loop_in_one_process(sweep):
    config, summary = sweep
    spec, _ = prepare_evaluation(config, summary["data"], summary["saes"])
    loop = evaluate_in_loop(spec)
    spark_rows = json.loads((Path(summary["evaluation"]) / "results.json").read_text())["saes"]
    for mine, theirs in zip(loop, spark_rows, strict=True):
        for key, value in mine.items():
            if isinstance(value, float) and key != "eval_seconds":
                assert theirs[key] == pytest.approx(value, abs=1e-6), key
        for key, _, _ in CORE_FIGURES:
            assert theirs[key] == pytest.approx(mine["core"][key], abs=1e-6), key
        for task, accuracies in mine["probe"]["tasks"].items():
            assert accuracies == pytest.approx(theirs["probe"]["tasks"][task], abs=1e-6)
        assert mine["per_parent_absorption"] == pytest.approx(theirs["per_parent_absorption"],
                                                              abs=1e-6)  # fmt: skip


def test_a_rerun_reuses_every_stage(spark, sweep):
    config, summary = sweep
    again = run_sweep(spark, config, log=lambda *_: None)
    assert again["reused"] == {"saes": 4, "evaluation": True}
    assert again["saes"] == summary["saes"] and again["report"] == summary["report"]


def test_bad_configs_are_refused_before_anything_runs(tmp_path):
    with pytest.raises(InvalidArgumentError, match=r"families \['relu'\]: choose among"):
        SweepConfig(families=("relu",))
    with pytest.raises(InvalidArgumentError, match=r"exceed eval_rows"):
        SweepConfig(eval_rows=1000)
    with pytest.raises(InvalidArgumentError, match=r"\[sae\] may not set \['k'\]"):
        SweepConfig(sae={"k": 4})
    with pytest.raises(InvalidArgumentError, match="unknown config key"):
        SweepConfig(sae={"learning_rate": 1e-3})
    toml = tmp_path / "sweep.toml"
    toml.write_text("widths = [64]\nwidht = 3\n[model]\nnum_features = 64\nhidden_dim = 8\n")
    with pytest.raises(InvalidArgumentError, match=r"unknown sweep setting\(s\) \['widht'\]"):
        SweepConfig.load(toml)
    assert main(["sweep", "--config", str(toml)]) == 2  # one line, no traceback
    shipped = SweepConfig.load(Path(__file__).parents[2] / "conf" / "sweep-synth.toml")
    assert len(shipped.grid()) >= 8 and shipped.model.hierarchy is not None
