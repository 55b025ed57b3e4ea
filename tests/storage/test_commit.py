"""The commit protocol, driven through the data source's writer the way Spark drives it
(planning, task attempts, one commit): losing attempts, killed drivers, racing commits."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
from direct_writes import batch, files, writer

from pyspark_safetensors.dataset import ConcurrentCommitError, DatasetLocation, load_manifest
from pyspark_safetensors.dataset.commit import _publish_manifest
from pyspark_safetensors.spark.writer import JobEndedError
from pyspark_safetensors.torch import open_dataset


def test_losing_attempt_and_failed_attempt_leave_nothing(tmp_path):
    root = tmp_path / "ds"
    w = writer(root, overwrite=True)
    winner = w.write(iter([batch(0, 10)]))
    loser = w.write(iter([batch(0, 10)]))  # a speculative copy of the same task
    with pytest.raises(RuntimeError, match="dies"):

        def dying():
            yield batch(0, 8)
            raise RuntimeError("attempt dies")

        w.write(dying())
    assert len([f for f in files(root) if f.startswith("part-")]) == 2 * 3
    w.commit([winner])
    m = json.loads((root / "dataset_manifest.json").read_text())
    listed = sorted(s["shard_path"] for s in m["shards"])
    assert [s.final_name for s in winner.result.shards] == listed
    assert not {s.final_name for s in loser.result.shards} & set(files(root))
    assert files(root) == sorted([*listed, "_SUCCESS", "dataset_manifest.json"])
    ds = open_dataset(root, checksums=True)
    assert sorted(ds[i]["id"].item() for i in range(len(ds))) == list(range(10))


@pytest.mark.parametrize("end", ["abort", "commit"])
def test_attempt_finishing_after_its_job_ended_leaves_nothing(tmp_path, end):
    root = tmp_path / "ds"
    w = writer(root, overwrite=True)
    if end == "commit":
        w.commit([w.write(iter([batch(0, 4)]))])
    else:
        w.abort([])
    before = files(root)
    with pytest.raises(JobEndedError, match=r"ended .* before this task finished"):
        w.write(iter([batch(0, 10)]))  # a straggler Spark no longer waits for
    assert files(root) == before
    assert root.exists() == (end == "commit")  # an aborted first write leaves no directory


def test_racing_commits_are_detected(tmp_path):
    root = tmp_path / "ds"
    w = writer(root, overwrite=True)
    w.commit([w.write(iter([batch(0, 4)]))])
    loc = DatasetLocation.of(root)
    stale = load_manifest(loc)
    a = writer(root)
    a.commit([a.write(iter([batch(4, 4)]))])
    with pytest.raises(ConcurrentCommitError, match="another write committed"):
        _publish_manifest(loc, stale, stale)
    assert load_manifest(loc).total_samples == 8
    # a stale lock left by a dead process on this host is broken, not waited on
    (root / "_commit.lock").write_text(json.dumps({"host": os.uname().nodename, "pid": 2**22 + 7}))
    b = writer(root)
    b.commit([b.write(iter([batch(8, 4)]))])
    assert load_manifest(loc).total_samples == 12 and not (root / "_commit.lock").exists()


KILLED_DRIVER = textwrap.dedent(
    """
    import os, signal, sys
    sys.path[:0] = [sys.argv[3]]
    from test_commit import writer, batch
    from pyspark_safetensors.dataset import commit
    w = writer(sys.argv[1], overwrite=sys.argv[2] == "overwrite", name_col="key", columns="vec")
    messages = [w.write(iter([batch(100, 6)])), w.write(iter([batch(200, 6)]))]
    def die(*args, **kwargs):  # the driver is killed between the index put and the manifest put
        os.kill(os.getpid(), signal.SIGKILL)
    commit._publish_manifest = die
    w.commit(messages)
    """
)


@pytest.mark.parametrize("mode", ["append", "overwrite"])
def test_driver_killed_mid_commit_keeps_the_previous_dataset(tmp_path, mode):
    root = tmp_path / "kv"
    w = writer(root, overwrite=True, name_col="key", columns="vec")
    w.commit([w.write(iter([batch(0, 6)]))])
    before = files(root)
    done = subprocess.run(
        [sys.executable, "-c", KILLED_DRIVER, str(root), mode, os.path.dirname(__file__)],
        capture_output=True,
        timeout=120,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-2000:]
    orphans = sorted(set(files(root)) - set(before))
    assert any(o.startswith("part-") for o in orphans) and any(
        "_tensor_index" in o for o in orphans
    )
    # the previous dataset is whole and reads exactly as before, its index included
    ds = open_dataset(root, checksums=True)
    assert sorted(ds.keys()) == [f"k{i}" for i in range(6)]
    assert ds.get("k3", "vec").tolist() == [3.0, 3.5]
    # the next commit reclaims what the dead job left (its lease names a dead process)
    w = writer(root, name_col="key", columns="vec")
    w.commit([w.write(iter([batch(6, 2)]))])
    assert not set(orphans) & set(files(root))
    assert sorted(open_dataset(root).keys()) == sorted(f"k{i}" for i in range(8))
