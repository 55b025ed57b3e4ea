"""Training that follows a growing dataset (``SAEConfig.follow``): the run starts on the
first commit, takes each commit as it lands, and ends at the token budget or once the
dataset is complete and read; it resumes exactly from its checkpoints."""

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from gloo_workers import spawn_two
from pyspark_safetensors.dataset import DatasetBuilder, mark_complete
from pyspark_safetensors.sae import SAEConfig, load_sae
from pyspark_safetensors.sae.checkpoint import SAE_TENSORS
from pyspark_safetensors.sae.train import Trainer

COMMIT = 1024  # rows per commit (one shard each)
pytestmark = pytest.mark.filterwarnings("ignore:.*the schedule leaves little room")


def rows(first, n, d=16):
    """Sparse sums of 3 atoms of a fixed dictionary (the commit at ``first`` seeds them)."""
    dictionary = np.random.default_rng(0).standard_normal((48, d)).astype(np.float32)
    rng = np.random.default_rng(first + 1)
    codes = np.zeros((n, 48), np.float32)
    picked = np.argsort(rng.random((n, 48)), axis=1)[:, :3]
    np.put_along_axis(codes, picked, rng.uniform(0.5, 2, (n, 3)).astype(np.float32), axis=1)
    return codes @ dictionary


def append(root, first, n=COMMIT):
    with DatasetBuilder(root, batch_size=COMMIT, metadata={"hook_point": "toy.h"}) as build:
        ids = np.arange(first, first + n, dtype=np.int64)
        build.add_batch({"activation": rows(first, n), "sample_id": ids})


def config(root, out, **kw):
    base = dict(dataset=str(root), n_latents=64, k=4, batch_size=256, tokens=256 * 40,
                warmup_steps=2, lr=2e-3, out_dir=str(out), log_every=4, checkpoints=2,
                progress=False, plots=False, follow=True, follow_poll_s=0.01,
                follow_timeout_s=20.0)  # fmt: skip
    return SAEConfig(**{**base, **kw})


def test_follow_needs_a_budget():
    with pytest.raises(ValueError, match="follow needs tokens"):
        SAEConfig(follow=True)
    assert SAEConfig().config_hash() == SAEConfig(follow_timeout_s=5).config_hash()
    assert SAEConfig(tokens=8).config_hash() != SAEConfig(tokens=8, follow=True).config_hash()


def produce(root, commits=4, pause=0.2):
    """Append ``commits`` commits a ``pause`` apart, then mark the dataset complete."""
    for first in range(0, commits * COMMIT, COMMIT):
        append(root, first)
        time.sleep(pause)
    mark_complete(root)


def test_a_run_follows_commits_as_they_land_and_ends_when_complete(tmp_path):
    root = tmp_path / "acts"
    writer = threading.Thread(target=produce, args=(root,))
    writer.start()  # the run starts before most of the data exists
    trainer = Trainer(config(root, tmp_path / "run"))
    assert len(trainer.dataset) < 4 * COMMIT  # it opened the first commit(s) only
    metrics = trainer.fit()
    writer.join()
    # every row once (4,096 rows, 16 batches of 256), before the 40 steps of the budget
    assert (metrics["step"], metrics["tokens"]) == (16, 4 * COMMIT)
    log = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert log[-1]["step"] == 16  # the last step is logged as the run's last
    assert (tmp_path / "run" / "sae.safetensors").is_file()


def test_a_run_stops_at_its_budget_without_waiting_for_more(tmp_path):
    root = tmp_path / "acts"
    for first in range(0, 3 * COMMIT, COMMIT):
        append(root, first)  # never marked complete
    trainer = Trainer(config(root, tmp_path / "run", tokens=256 * 10, follow_timeout_s=2.0))
    metrics = trainer.fit()
    assert (metrics["step"], metrics["tokens"]) == (10, 2560)


def test_a_following_run_resumes_exactly(tmp_path):
    root = tmp_path / "acts"
    for first in range(0, 3 * COMMIT, COMMIT):
        append(root, first)
    mark_complete(root)
    full = Trainer(config(root, tmp_path / "a", tokens=256 * 12))
    full.fit()
    part = Trainer(config(root, tmp_path / "b", tokens=256 * 12))
    stop = min(part.checkpoint_steps())
    part.total_steps = stop
    part.fit()
    resumed = Trainer(config(root, tmp_path / "b", tokens=256 * 12, resume="auto"))
    resumed.load(tmp_path / "b" / "checkpoints" / f"step-{stop:08d}")
    resumed.fit()
    a, _ = load_sae(tmp_path / "a" / "sae.safetensors")
    b, _ = load_sae(tmp_path / "b" / "sae.safetensors")
    for name in SAE_TENSORS:
        assert torch.equal(a[name], b[name]), name


def _data_parallel_worker(rank, tmp, root):
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank,
                            world_size=2, timeout=timedelta(seconds=120))  # fmt: skip
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("data", "model"))
    try:
        trainer = Trainer(config(root, f"{tmp}/run", data_parallel_size=2), mesh)
        metrics = trainer.fit()
        Path(f"{tmp}/rank{rank}.json").write_text(json.dumps(metrics))
        dist.barrier()  # both ranks done before teardown
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_data_parallel_ranks_follow_together_and_end_at_the_same_step(tmp_path):
    # the ranks poll on their own, yet split every commit the same way and learn the end
    # at the same step: neither is left waiting in a collective (a mistake there hangs a
    # run, which the loader's own rank tests cannot show; ~10 s of CPU for 2 processes)
    root = tmp_path / "acts"
    writer = threading.Thread(target=produce, args=(root,))
    writer.start()
    spawn_two(_data_parallel_worker, str(tmp_path), str(root))
    writer.join()
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert (ranks[0]["step"], ranks[0]["tokens"]) == (16, 4 * COMMIT)  # every row, once
    assert ranks[0]["fvu"] == ranks[1]["fvu"] and ranks[0]["step"] == ranks[1]["step"]
    assert (tmp_path / "run" / "sae.safetensors").is_file()
