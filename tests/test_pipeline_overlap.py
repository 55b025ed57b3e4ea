"""The pipeline with its extraction and training at once (``[pipeline] overlap``), through
the real CLI on the tiny toy Llama: a run killed in the middle of its extraction leaves no
stage taken as finished, the rerun builds it again, its datasets end complete, and the
training took every row once, as the same pipeline run one stage after the other does.

One module of about 50 s on 2 cores: four pipeline processes (the killed one, the
overlapped rerun, the sequential run, and one whose extraction fails mid-run), the only
end-to-end checks of overlapping stages."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from pyspark_safetensors.dataset import load_manifest

pytestmark = pytest.mark.integration

HOOK = "model.layers.1.mlp.gate_proj:input"
SLUG = "model_layers_1_mlp_gate_proj_input"
CONFIG = f"""
[pipeline]
model = "toy-llama"
texts = 16
held_out_texts = 4
max_length = 0
master = "local[1]"
nproc = 1
epochs = 1
ms = [0]
features = false
llama3_8b_latency = false
overlap = {{overlap}}
overlap_groups = 4
[pipeline.hooks]
"{HOOK}" = ["model.layers.1.mlp.gate_proj"]
[toy_lm]
preset = "tiny"
steps = 4
[sae]
expansion_factor = 2
k = 8
batch_size = 64
follow_poll_s = 0.1
seed = {{seed}}
"""


def _command(work: Path, overlap: bool) -> list[str]:
    name = f"{'overlap' if overlap else 'sequential'}.toml"
    seed = os.environ.get("PSS_TEST_SEED", "0")  # the ``seed`` fixture's, for a module's runs
    (work / name).write_text(CONFIG.format(overlap=str(overlap).lower(), seed=seed))
    return [sys.executable, "-m", "pyspark_safetensors.cli", "pipeline", "--config", name,
            "--out", "run"]  # fmt: skip


def _kill_at_first_commit(work: Path, env: dict) -> Path:
    """The overlapped run, killed (its process group: driver, JVM and workers) once its
    extraction's first commit lands; returns the extract stage's directory."""
    process = subprocess.Popen(
        _command(work, True), cwd=work, env=env, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline and process.poll() is None:
            landed = list(
                (work / "run").glob(f"extract-*/data/activations/{SLUG}/dataset_manifest.json")
            )
            if landed:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                return landed[0].parents[3]
            time.sleep(0.02)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    pytest.fail(f"no commit landed before the run ended (exit code {process.returncode})")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("pipeline-overlap")
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable}
    killed = _kill_at_first_commit(work, env)
    state = {
        "marker": (killed / ".unfinished").is_file(),
        "complete": load_manifest(killed / "data" / "activations" / SLUG).complete,
        "linked": (work / "run" / "extract").exists(),
        "stages": sorted(
            p.name
            for p in (work / "run").iterdir()
            if p.is_dir() and not p.is_symlink() and not p.name.startswith(".")
        ),
    }
    summaries = {}
    for overlap in (True, False):
        result = subprocess.run(
            _command(work, overlap), cwd=work, env=env, capture_output=True, text=True,
            timeout=600,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        summaries[overlap] = json.loads((work / "run" / "summary.json").read_text())
    return work / "run", killed, state, summaries


def test_a_run_killed_mid_extraction_leaves_no_stage_taken_as_finished(runs):
    _, killed, state, summaries = runs
    assert state["marker"] and not state["complete"] and not state["linked"]
    # the toy model's stage was finished before the kill; no training stage was
    assert [s.split("-")[0] for s in state["stages"]] == ["extract", "model"], state["stages"]
    rerun = summaries[True]["stages"]["extract"]
    assert rerun == {"dir": killed.name, "hash": rerun["hash"], "reused": False}
    assert not (killed / ".unfinished").exists()
    assert summaries[True]["stages"]["model"]["reused"]


def _rows(extract_dir: Path) -> tuple[dict, np.ndarray]:
    """The manifest and the rows of the hook point's dataset, ordered by (sample, position)."""
    data = extract_dir / "data" / "activations" / SLUG
    manifest = load_manifest(data)
    shards = [load_file(data / s.shard_path) for s in manifest.shards]
    ids = np.concatenate([s["sample_id"] * 10_000 + s["token_pos"] for s in shards])
    acts = np.concatenate([s["activation"] for s in shards])
    return manifest, acts[np.argsort(ids, kind="stable")]


def test_datasets_end_complete_and_hold_the_sequential_runs_rows(runs):
    out, _, _, summaries = runs
    overlapped, sequential = (out / summaries[o]["stages"]["extract"]["dir"] for o in (True, False))
    assert overlapped != sequential
    m_over, rows_over = _rows(overlapped)
    m_seq, rows_seq = _rows(sequential)
    assert m_over.complete and not m_seq.complete
    assert len(m_over.shards) >= 4  # a commit per group of texts
    assert load_manifest(overlapped / "data" / "samples").complete
    np.testing.assert_array_equal(rows_over, rows_seq)  # the same model on the same texts
    assert summaries[True]["extraction"]["tokens"] == summaries[False]["extraction"]["tokens"]


@pytest.mark.trained
def test_training_took_every_row_once_as_the_sequential_run(runs, figure):
    """Spread of the held-out FVUs' difference (tests/margins.py, seeds 0-4 on the pinned
    CPU path, 1 and 2 threads): 0.008-0.043 against < 0.15 (margin +71 %)."""
    out, _, _, summaries = runs
    tokens = summaries[True]["extraction"]["tokens"]
    over, seq = (summaries[o]["training"][HOOK] for o in (True, False))
    assert over["tokens"] == seq["tokens"] == tokens // 64 * 64
    assert over["step"] == seq["step"] == tokens // 64
    config = json.loads(
        (out / summaries[True]["stages"][f"sae-{SLUG}"]["dir"] / "config.json").read_text()
    )
    assert config["follow"] and config["dataset"].endswith(
        f"{summaries[True]['stages']['extract']['dir']}/data/activations/{SLUG}"
    )
    # the same rows in another order: held-out figures of the same size
    fvu = {o: summaries[o]["evaluation"]["sae"][HOOK]["fvu"] for o in (True, False)}
    # which rows the training saw in which order follows the extraction's timing
    figure("fvu_overlapped_minus_sequential", abs(fvu[True] - fvu[False]), below=0.15,
           context=fvu, timed=True)  # fmt: skip


def test_overlap_takes_one_epoch_and_groups_within_the_texts():
    from pyspark_safetensors.pipeline import PipelineConfig, PipelineError

    with pytest.raises(PipelineError, match="epochs = 1"):
        PipelineConfig(overlap=True, epochs=4)
    with pytest.raises(PipelineError, match="overlap_groups"):
        PipelineConfig(overlap=True, epochs=1, texts=4, overlap_groups=8)
    assert PipelineConfig(overlap=True, epochs=1).overlap_groups == 8


def test_the_training_runs_in_the_background_with_the_callers_torch_threads():
    """The overlapped training's thread: the torch threads asked (default: those of the
    thread that started it), the lowest CPU priority when asked (Linux: a thread's own nice
    value), its error handed back."""
    import threading

    import torch

    from pyspark_safetensors.pipeline.overlap import _in_background

    def probe():
        tid = threading.get_native_id()
        return os.getpriority(os.PRIO_PROCESS, tid), torch.get_num_threads(), tid

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        nice, threads, tid = _in_background(probe, lowest_priority=True).result(timeout=30)
        normal, two, _ = _in_background(probe, threads=2).result(timeout=30)
        later = []  # a thread started after it has the caller's count, not the training's
        thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
        thread.start()
        thread.join()
    finally:
        torch.set_num_threads(before)
    assert threads == 1 and two == 2 and later == [1] and tid != threading.get_native_id()
    caller = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert normal == caller < 19  # the caller's kept
    if sys.platform.startswith("linux"):
        assert nice == 19

    def fails():
        raise ValueError("the training's own error")

    with pytest.raises(ValueError, match="own error"):
        _in_background(fails).result(timeout=30)


def test_an_extraction_that_fails_stops_the_run_at_once(tmp_path):
    """A group's commit fails (its dataset's directory replaced by a file) while a training
    run follows another dataset: the run ends at once with the extraction's error, not the
    follower's (the failed extraction deletes what it followed) nor after its timeout (600
    s), and leaves no extract stage behind."""
    other, other_slug = "model.layers.0.mlp.gate_proj:input", "model_layers_0_mlp_gate_proj_input"
    config = CONFIG.format(overlap="true", seed=0).replace(
        "[pipeline.hooks]\n", f'[pipeline.hooks]\n"{other}" = ["model.layers.0.mlp.gate_proj"]\n'
    )
    (tmp_path / "overlap.toml").write_text(config)
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable}
    process = subprocess.Popen(
        [sys.executable, "-m", "pyspark_safetensors.cli", "pipeline", "--config",
         "overlap.toml", "--out", "run"],
        cwd=tmp_path, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        pattern = "extract-*/data/activations/{}/dataset_manifest.json"
        deadline = time.monotonic() + 300
        while not all(list((tmp_path / "run").glob(pattern.format(s))) for s in (SLUG, other_slug)):
            assert process.poll() is None and time.monotonic() < deadline, "no first commit"
            time.sleep(0.02)
        # the run on layer 0 trains first (runs in name order): layer 1's commit breaks
        broken = next((tmp_path / "run").glob(pattern.format(SLUG))).parent
        broken.rename(broken.with_name("moved-away"))
        broken.write_text("not a dataset")
        _, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode != 0
    assert "vanished" not in stderr and "no new rows" not in stderr, stderr[-3000:]
    assert not list((tmp_path / "run").glob("extract-*")), stderr[-3000:]
