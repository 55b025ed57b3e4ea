"""The commit protocol, driven through each implementation's writer the way Spark drives
it (planning, task attempts, one commit): losing attempts, stragglers, killed drivers,
racing commits."""

import functools
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("pyspark.sql.datasource", reason="this Spark has no Python data sources")

from direct_writes import JvmWriter, PythonWriter, batch, files, writer

from implementations import require
from pyspark_safetensors.dataset import ConcurrentCommitError, DatasetLocation, load_manifest
from pyspark_safetensors.dataset.commit import _publish_manifest
from pyspark_safetensors.spark.writer import JobEndedError
from pyspark_safetensors.torch import open_dataset

BOTH = ["python", pytest.param("jvm", marks=pytest.mark.jvm)]


@pytest.fixture(params=BOTH)
def implementation(request):
    return request.param


@pytest.fixture
def make_writer(implementation):
    """``make_writer(path, overwrite=False, **options)``: a writer of ``implementation``."""
    if implementation == "python":
        return PythonWriter
    from spark_sessions import spark_session

    spark = spark_session("local")
    require(spark, "jvm")
    return functools.partial(JvmWriter, spark)


def ended_error(implementation):
    """What a task attempt raises when its job ended before it finished."""
    if implementation == "python":
        return JobEndedError
    from py4j.protocol import Py4JJavaError

    return Py4JJavaError


def test_losing_attempt_and_failed_attempt_leave_nothing(tmp_path, make_writer):
    root = tmp_path / "ds"
    w = make_writer(root, overwrite=True)
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
    assert winner.shards == listed
    assert not set(loser.shards) & set(files(root))
    assert files(root) == sorted([*listed, "_SUCCESS", "dataset_manifest.json"])
    ds = open_dataset(root, checksums=True)
    assert sorted(ds[i]["id"].item() for i in range(len(ds))) == list(range(10))


@pytest.mark.parametrize("end", ["abort", "commit"])
def test_attempt_finishing_after_its_job_ended_leaves_nothing(
    tmp_path, make_writer, implementation, end
):
    root = tmp_path / "ds"
    w = make_writer(root, overwrite=True)
    if end == "commit":
        w.commit([w.write(iter([batch(0, 4)]))])
    else:
        w.abort([])
    before = files(root)
    with pytest.raises(ended_error(implementation), match=r"ended .* before this task finished"):
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


def test_a_stale_commit_lock_is_broken(tmp_path, make_writer):
    root = tmp_path / "ds"
    w = make_writer(root, overwrite=True)
    w.commit([w.write(iter([batch(0, 4)]))])
    # a lock left by a dead process on this host is broken, not waited on
    (root / "_commit.lock").write_text(json.dumps({"host": os.uname().nodename, "pid": 2**22 + 7}))
    b = make_writer(root)
    b.commit([b.write(iter([batch(4, 4)]))])
    assert load_manifest(DatasetLocation.of(root)).total_samples == 8
    assert not (root / "_commit.lock").exists()


# Each script writes k100..k105 and k200..k205 in two task attempts and dies between the
# index put and the manifest put: the Python driver by SIGKILL from inside the commit; the
# JVM driver halted by the shim's object-store test file system as it creates the manifest.
KILLED_DRIVER = {
    "python": """
        import os, signal, sys
        sys.path[:0] = [sys.argv[3]]
        from direct_writes import writer, batch
        from pyspark_safetensors.dataset import commit
        w = writer(sys.argv[1], overwrite=sys.argv[2] == "overwrite", name_col="key", columns="vec")
        messages = [w.write(iter([batch(100, 6)])), w.write(iter([batch(200, 6)]))]
        def die(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)
        commit._publish_manifest = die
        w.commit(messages)
        """,
    "jvm": """
        import sys
        import pyarrow as pa
        sys.path[:0] = [sys.argv[3]]
        from direct_writes import SCHEMA, batch
        from pyspark_safetensors.spark.session import local_session
        spark = local_session("local[2]", **{"spark.ui.showConsoleProgress": "false"})
        conf = spark.sparkContext._jsc.hadoopConfiguration()
        conf.set("fs.stlocal.impl", "io.github.pysparksafetensors.testing.LocalObjectStore")
        conf.set("fs.stlocal.impl.disable.cache", "true")
        conf.set("fs.stlocal.halt-on-create", "dataset_manifest.json")
        table = pa.Table.from_batches([batch(100, 6), batch(200, 6)])
        df = spark.createDataFrame(table, schema=SCHEMA).repartition(2)
        jvm = spark.sparkContext._gateway.proc
        try:
            (df.write.format("safetensors").option("implementation", "jvm")
             .option("name_col", "key").option("columns", "vec")
             .mode(sys.argv[2]).save("stlocal://" + sys.argv[1]))
        except Exception:
            sys.exit(jvm.wait())  # reaped: its lease then names a dead process
        """,
}


@pytest.mark.parametrize("mode", ["append", "overwrite"])
def test_driver_killed_mid_commit_keeps_the_previous_dataset(
    tmp_path, make_writer, implementation, mode
):
    root = tmp_path / "kv"
    w = make_writer(root, overwrite=True, name_col="key", columns="vec")
    w.commit([w.write(iter([batch(0, 6)]))])
    before = files(root)
    script = textwrap.dedent(KILLED_DRIVER[implementation])
    done = subprocess.run(
        [sys.executable, "-c", script, str(root), mode, os.path.dirname(__file__)],
        capture_output=True,
        timeout=180,
    )
    killed = -signal.SIGKILL if implementation == "python" else 137
    assert done.returncode == killed, done.stderr.decode()[-3000:]
    orphans = sorted(set(files(root)) - set(before))
    assert any(o.startswith("part-") for o in orphans) and any(
        "_tensor_index" in o for o in orphans
    )
    # the previous dataset is whole and reads exactly as before, its index included
    ds = open_dataset(root, checksums=True)
    assert sorted(ds.keys()) == [f"k{i}" for i in range(6)]
    assert ds.get("k3", "vec").tolist() == [3.0, 3.5]
    # the next commit reclaims what the dead job left (its lease names a dead process)
    w = make_writer(root, name_col="key", columns="vec")
    w.commit([w.write(iter([batch(6, 2)]))])
    assert not set(orphans) & set(files(root))
    assert sorted(open_dataset(root).keys()) == sorted(f"k{i}" for i in range(8))
