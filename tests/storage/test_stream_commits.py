"""A commit that knows its stream's batch id: a replayed batch publishes nothing and
leaves nothing, streams share a dataset, every commit carries ``stream_commits`` forward,
and a dataset marked complete takes no append. The tasks' and the driver's calls of the
Python sink are made by hand, in the order Spark makes them (no Spark job)."""

import copy
import json
import time

import pytest

pytest.importorskip("pyspark.sql.datasource", reason="this Spark has no Python data sources")

from direct_writes import SCHEMA, PythonWriter, batch, files

from pyspark_safetensors.dataset import (
    CompleteDatasetError,
    DatasetLocation,
    Manifest,
    ManifestError,
    StreamBatch,
    begin_stream_batch,
    lease_name,
    load_manifest,
    mark_complete,
)
from pyspark_safetensors.spark.stream import commit_stream_batch, stream_writer

pytestmark = pytest.mark.unit


def sink(path, **options):
    opts = {"path": str(path), "columns": "id,vec", "batch_size": "4", **options}
    return stream_writer(opts, SCHEMA, False)


def run_tasks(path, stream, batch_id, *parts, check=True, **options):
    """The micro-batch's tasks: each leases the batch and writes its part (``check=False``:
    written as a task that ran before the batch's first commit landed)."""
    writer = sink(path, **options)
    b = StreamBatch(stream, batch_id)
    results = []
    for task, (start, n) in enumerate(parts):
        if not check:  # leased before the batch's first commit landed
            writer.job.location.put_json(lease_name(b.job_id), {"started": time.time()})
        elif not begin_stream_batch(writer.job.location, b):
            continue
        job = writer.job.for_job(b.job_id)
        results.append(job.write_partition(iter([batch(start, n)]), task, 100 * batch_id + task))
    return writer, b, results


def commit(path, stream, batch_id, *parts, check=True, **options):
    writer, b, results = run_tasks(path, stream, batch_id, *parts, check=check, **options)
    return commit_stream_batch(writer.job, b, results)


def ids(path):
    from pyspark_safetensors.torch import open_dataset

    ds = open_dataset(path)
    return sorted(int(i) for k in range(len(ds)) for i in [ds[k]["id"]])


def test_a_replayed_batch_commits_nothing_and_leaves_nothing(tmp_path):
    root = tmp_path / "ds"
    first = commit(root, "q1", 0, (0, 8), (8, 5))
    before = files(root)
    # the driver died after the commit point, before Spark logged the batch: the replay's
    # tasks see the batch committed and write nothing
    _, _, results = run_tasks(root, "q1", 0, (0, 8), (8, 5))
    assert results == [] and files(root) == before
    # tasks that wrote before the first run's commit landed: the replay's commit deletes them
    replay = commit(root, "q1", 0, (0, 8), (8, 5), check=False)
    assert replay.commit_id == first.commit_id == load_manifest(root).commit_id
    assert files(root) == before
    assert ids(root) == list(range(13))


def test_a_batch_after_a_crash_reclaims_what_the_crashed_run_wrote(tmp_path):
    root = tmp_path / "ds"
    commit(root, "q1", 0, (0, 4))
    shards_before = {n for n in files(root) if n.endswith(".safetensors")}
    run_tasks(root, "q1", 1, (4, 6))  # batch 1's first run: the driver dies before its commit
    crashed = {n for n in files(root) if n.endswith(".safetensors")} - shards_before
    assert len(crashed) == 2
    manifest = commit(root, "q1", 1, (4, 6))  # the restart replays batch 1
    listed = {s.shard_path for s in manifest.shards}
    assert {n for n in files(root) if n.endswith(".safetensors")} == listed
    assert not crashed & listed
    assert not (root / "_temporary").exists()
    assert manifest.stream_commits == {"q1": 1} and ids(root) == list(range(10))


def test_two_streams_append_to_one_dataset_each_exactly_once(tmp_path):
    root = tmp_path / "ds"
    commit(root, "a", 0, (0, 4))
    commit(root, "b", 0, (100, 4))
    commit(root, "a", 1, (4, 4))
    commit(root, "b", 0, (100, 4), check=False)  # b's replay
    commit(root, "b", 1, (104, 2))
    manifest = load_manifest(root)
    assert manifest.stream_commits == {"a": 1, "b": 1}
    assert ids(root) == [*range(8), *range(100, 106)]


def test_stream_commits_are_carried_by_every_commit(tmp_path):
    root = tmp_path / "ds"
    commit(root, "a", 3, (0, 4))
    w = PythonWriter(root, batch_size="4")  # a batch append
    w.commit([w.write(iter([batch(4, 4)]))])
    assert load_manifest(root).stream_commits == {"a": 3}
    w = PythonWriter(root, overwrite=True, batch_size="4")  # an overwrite keeps them too
    w.commit([w.write(iter([batch(0, 2)]))])
    assert load_manifest(root).stream_commits == {"a": 3}
    commit(root, "a", 3, (50, 4), check=False)  # so the stream's replay still commits nothing
    assert ids(root) == [0, 1]
    doc = json.loads((root / "dataset_manifest.json").read_text())
    assert doc["stream_commits"] == {"a": 3} and "complete" not in doc


def test_a_complete_dataset_takes_no_append(tmp_path):
    root = tmp_path / "ds"
    with pytest.raises(ValueError, match=r"no dataset_manifest\.json to mark complete"):
        mark_complete(root)
    commit(root, "a", 0, (0, 4))
    before = load_manifest(root)
    done = mark_complete(root)
    assert done.complete and done.parent_commit == before.commit_id
    assert done.shards == before.shards and done.stream_commits == before.stream_commits
    assert mark_complete(root) == done  # again: nothing changes
    assert json.loads((root / "dataset_manifest.json").read_text())["complete"] is True
    with pytest.raises(CompleteDatasetError, match="is marked complete"):
        sink(root)  # a stream starting on it: refused before any batch runs
    with pytest.raises(CompleteDatasetError, match="is marked complete"):
        PythonWriter(root, batch_size="4")
    with pytest.raises(CompleteDatasetError, match="is marked complete"):
        commit(root, "a", 1, (4, 4))  # a stream already running: refused at commit
    assert load_manifest(root) == done and not (root / "_temporary").exists()
    w = PythonWriter(root, overwrite=True, batch_size="4")
    w.commit([w.write(iter([batch(0, 2)]))])
    assert not load_manifest(root).complete


def test_the_fields_are_checked_against_the_schema(tmp_path):
    root = tmp_path / "ds"
    commit(root, "a", 0, (0, 4))
    mark_complete(root)
    doc = json.loads((root / "dataset_manifest.json").read_text())
    assert Manifest.from_json(doc, "m") == load_manifest(DatasetLocation.of(root))
    for change, message in [
        (lambda d: d.update(stream_commits={"a": -1}), "stream_commits.a: -1 is less than"),
        (lambda d: d.update(stream_commits={"a": "1"}), "stream_commits.a: '1' is not of type"),
        (lambda d: d.update(stream_commits={"": 1}), "stream_commits"),
        (lambda d: d.update(complete="yes"), "complete: 'yes' is not of type 'boolean'"),
    ]:
        bad = copy.deepcopy(doc)
        change(bad)
        with pytest.raises(ManifestError, match=message):
            Manifest.from_json(bad, "m")


def test_a_stream_batch_needs_its_ids():
    with pytest.raises(ValueError, match="stream id and a batch id"):
        StreamBatch("", 0)
    with pytest.raises(ValueError, match="stream id and a batch id"):
        StreamBatch("q", -1)
    assert StreamBatch("q", 1).job_id == StreamBatch("q", 1).job_id != StreamBatch("q", 2).job_id


def test_a_batch_whose_commit_races_another_streams_is_committed_on_a_retry(tmp_path, monkeypatch):
    import pyspark_safetensors.dataset.commit as protocol

    root = tmp_path / "ds"
    commit(root, "a", 0, (0, 4))
    publish, raced = protocol._publish_manifest, []

    def racing(location, manifest, previous):
        if not raced:  # stream b's batch lands between a's read of the manifest and its put
            raced.append(None)
            raced[0] = commit(root, "b", 0, (100, 4))
        return publish(location, manifest, previous)

    monkeypatch.setattr(protocol, "_publish_manifest", racing)
    manifest = commit(root, "a", 1, (4, 4))
    assert manifest.parent_commit == raced[0].commit_id
    assert manifest.stream_commits == {"a": 1, "b": 0}
    assert ids(root) == [*range(8), *range(100, 104)]
    assert {n for n in files(root) if n.endswith(".safetensors")} == {
        s.shard_path for s in manifest.shards
    }


def committed_by(path, **options):
    """Batch 0 of a sink with ``options`` written by one task and committed by the driver,
    as Spark calls them; returns the sink."""
    from pyspark_safetensors.spark.stream import BatchCommit

    writer = sink(path, **options)
    b = writer._batch("query", 0)
    assert begin_stream_batch(writer.job.location, b)
    result = writer.job.for_job(b.job_id).write_partition(iter([batch(0, 8)]), 0, 1)
    writer.commit([BatchCommit(b.stream_id, 0, result)], 0)
    return writer


def test_a_stream_id_is_refused_under_another_checkpoint(tmp_path):
    """Under a new checkpoint Spark numbers the batches from 0 again: every batch of a
    reused stream id would be taken for a replay and dropped, so the sink refuses it."""
    from pyspark_safetensors.spark.stream import StreamError

    root, a, b = tmp_path / "ds", tmp_path / "ckA", tmp_path / "ckB"
    committed_by(root, stream_id="s1", checkpointLocation=str(a))
    manifest = load_manifest(root)
    assert manifest.stream_commits == {"s1": 0}
    assert manifest.stream_checkpoints == {"s1": f"file:{a}"}
    with pytest.raises(StreamError, match=r"'s1' committed its batches up to 0 from checkpoint"):
        sink(root, stream_id="s1", checkpointLocation=str(b))
    sink(root, stream_id="s1", checkpointLocation=f"file://{a}/")  # the same checkpoint
    sink(root, stream_id="s2", checkpointLocation=str(b))  # another stream
    sink(root, checkpointLocation=str(b))  # the query's own id: new with its checkpoint
    with pytest.raises(StreamError, match="partitioned writes are the JVM source's"):
        sink(root, partition_columns="key")  # the JVM sink's option, named, not unknown
    # every commit carries the checkpoints forward
    w = PythonWriter(root, batch_size="4")
    w.commit([w.write(iter([batch(8, 4)]))])
    assert load_manifest(root).stream_checkpoints == {"s1": f"file:{a}"}
    doc = json.loads((root / "dataset_manifest.json").read_text())
    bad = copy.deepcopy(doc) | {"stream_checkpoints": {"s1": ""}}
    with pytest.raises(ManifestError, match="stream_checkpoints"):
        Manifest.from_json(bad, "m")


@pytest.mark.parametrize("named", ["stream_id", "checkpoint"])
def test_an_aborted_batch_whose_tasks_all_failed_leaves_nothing(tmp_path, named):
    """No task succeeded, so no message names the stream: the sink takes it from its
    stream_id option, or the query id from the checkpoint's metadata."""
    root, checkpoint = tmp_path / "ds", tmp_path / "ck"
    checkpoint.mkdir()
    (checkpoint / "metadata").write_text(json.dumps({"id": "q7"}))
    commit(root, "s" if named == "stream_id" else "q7", 0, (0, 4))
    before = files(root)
    options = {"stream_id": "s"} if named == "stream_id" else {}
    writer = sink(root, checkpointLocation=str(checkpoint), **options)
    b = writer._batch("q7", 1)
    assert begin_stream_batch(writer.job.location, b)  # a task leases the batch, writes ...
    writer.job.for_job(b.job_id).write_partition(iter([batch(4, 4)]), 0, 1)
    assert files(root) != before
    writer.abort([None, None], 1)  # ... and fails, as does every other: no message
    assert files(root) == before


def test_a_replay_republishes_the_index_and_success(tmp_path):
    """A crash between a commit's manifest and its ``_tensor_index.parquet`` and
    ``_SUCCESS`` leaves them a commit behind; the batch's replay puts them back."""
    root, indexed = tmp_path / "ds", {"generate_index": "true"}
    commit(root, "q1", 0, (0, 8), **indexed)
    manifest = commit(root, "q1", 1, (8, 4), **indexed)
    index = (root / "_tensor_index.parquet" / "part-00000.parquet").read_bytes()
    assert index == (root / manifest.index_file).read_bytes()
    for check in (True, False):  # the replay's tasks see the batch committed, or ran before
        (root / "_tensor_index.parquet" / "part-00000.parquet").write_bytes(b"stale")
        (root / "_SUCCESS").unlink()
        commit(root, "q1", 1, (8, 4), check=check, **indexed)
        assert (root / "_tensor_index.parquet" / "part-00000.parquet").read_bytes() == index
        assert (root / "_SUCCESS").exists() and load_manifest(root) == manifest
