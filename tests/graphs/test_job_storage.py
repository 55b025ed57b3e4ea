"""The graph job on executors in separate processes (``local-cluster[2,1,1024]``, the
shared session that retries a failed task once) through the storage layer: the model,
the CLT, the prompts and the output in an S3 bucket (moto on loopback), every output file
in the bucket and nothing on a local disk, the expected attributions over its graphs
written there too, the output replaced whole by a second run (the
CLI's); a task attempt killed after it has written a graph: none of its files published,
nothing stray left beside the output (a local one and one in the bucket). Without Spark:
``StagedOutput`` leaving the old output as it was when the job fails, and ``local_copy``
copying a remote model once per version."""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

import numpy as np
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

pytest.importorskip("moto")

from pyspark_safetensors.dataset import MANIFEST, SUCCESS, DatasetLocation, verify_dataset
from pyspark_safetensors.graphs import job
from pyspark_safetensors.graphs.global_weights import expected_attributions
from pyspark_safetensors.graphs.job import GraphsConfig, run_graphs
from pyspark_safetensors.torch import open_dataset
from spark_sessions import Unstopped

# the adjacency dataset reaches s3:// through the Python source (the JVM one needs hadoop-aws)
pytestmark = [pytest.mark.spark, pytest.mark.python_source]

PROMPTS = ["The quick brown fox", "", "def main():", "import os", "x = 1"]


@pytest.fixture(scope="module")
def cluster():
    from spark_sessions import spark_session

    return spark_session("cluster")


def files(location: DatasetLocation) -> set[str]:
    return {n for n, i in location.list(recursive=True).items() if i.type == pafs.FileType.File}


def expected_files(summary: dict, adjacency: set[str]) -> set[str]:
    """What a finished output holds: the tables, the browser and each graph's files."""
    ok = set(range(summary["graphs"] + summary["failed"])) - {
        e["prompt_id"] for e in summary["errors"]
    }
    per_graph = {f"{kind}/prompt_id={i}/part-0.parquet" for i in ok for kind in ("nodes", "edges")}
    per_graph |= {f"data/graph-{i}.js" for i in ok}
    pages = {"index.html", "graph.html", "data/index.js", "data/pages.js"}
    return {
        "graphs.parquet",
        "graphs.json",
        *pages,
        *per_graph,
        *(f"adjacency/{n}" for n in adjacency),
    }


def check_output(out: DatasetLocation, summary: dict, n_prompts: int) -> None:
    """Every expected file and nothing else; the adjacency dataset whole and read back."""
    assert json.loads(out.read_bytes("graphs.json")) == json.loads(json.dumps(summary))
    manifest = verify_dataset(out.child("adjacency"), checksums=True)
    adjacency = files(out.child("adjacency"))
    shards = {s.shard_path for s in manifest.shards}
    assert {n for n in adjacency if n not in shards and not n.startswith("_tensor_index")} == {
        MANIFEST, SUCCESS,
    }  # fmt: skip
    assert files(out) == expected_files(summary, adjacency)
    table = pq.read_table(out.path("graphs.parquet"), filesystem=out.fs)
    assert table.column("prompt_id").to_pylist() == list(range(n_prompts))
    assert manifest.total_samples == summary["graphs"]


def snapshot(cluster) -> dict[str, set[str]]:
    """What is in the driver's working directory, each executor's (all under the
    application's folder on this master, seen from one task) and the temporary directory's
    top level: where a path taken for a local one (``s3:/bucket/...``) would land. (Other
    tests may add to the temporary directory meanwhile: its new names are checked.)"""

    def executors(_):
        import os

        app = os.path.dirname(os.getcwd())
        for name in os.listdir(app):
            yield os.path.join(app, name), sorted(os.listdir(os.path.join(app, name)))

    found = {"driver": set(os.listdir(".")), "tmp": set(os.listdir(tempfile.gettempdir()))}
    for cwd, names in cluster.sparkContext.parallelize([0], 1).mapPartitions(executors).collect():
        found[cwd] = set(names)
    return found


def test_graphs_from_and_to_s3_on_separate_executors(cluster, toy, dictionaries, s3_bucket,
                                                     s3_endpoint, tmp_path, monkeypatch):  # fmt: skip
    from pyspark_safetensors import cli
    from pyspark_safetensors.spark import session

    options = {"endpoint_url": s3_endpoint}
    bucket = DatasetLocation.of(s3_bucket, storage_options=options)
    pafs.copy_files(str(toy), bucket.path("models/toy"), destination_filesystem=bucket.fs)
    bucket.put_bytes("clt.safetensors", dictionaries["clt"].read_bytes())
    bucket.put_bytes("prompts.txt", "\n".join(PROMPTS).encode() + b"\n")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    before = snapshot(cluster)
    config = GraphsConfig(model=f"{s3_bucket}/models/toy", transcoders=(f"{s3_bucket}/clt.safetensors",),
                          prompts=f"{s3_bucket}/prompts.txt", output=f"{s3_bucket}/graphs",
                          partitions=2)  # fmt: skip
    summary = run_graphs(cluster, config, storage_options=options)
    assert (summary["graphs"], summary["failed"]) == (4, 1)
    out = DatasetLocation.of(config.output, storage_options=options)
    check_output(out, summary, len(PROMPTS))
    graph = open_dataset(f"{config.output}/adjacency", storage_options=options)["p3"]["adjacency"]
    assert graph.shape[0] == graph.shape[1] > 10 and np.isfinite(graph.numpy()).all()
    nodes = pq.read_table(out.path("nodes"), filesystem=out.fs).to_pandas()
    assert sorted(nodes.prompt_id.unique()) == [0, 2, 3, 4]
    # the expected attributions over them, from the bucket into it, through the tasks
    global_ = expected_attributions(cluster, config.output, f"{s3_bucket}/global", partitions=2,
                                    storage_options=options)  # fmt: skip
    expected = bucket.child("global/expected_attributions")
    table = pq.read_table(expected.root, filesystem=expected.fs, partitioning="hive")
    assert table.num_rows == global_["pairs"] > 0 and global_["graphs"] == 4
    assert set(table.column("target_layer").to_pylist()) == {1}
    assert "_expected_attributions.json" in files(expected)
    assert all(re.fullmatch(r"target_layer=1/part-\d{5}\.parquet", n)
               for n in files(expected) if n != "_expected_attributions.json")  # fmt: skip
    # nothing beside them in the bucket (no staging prefix left), nothing on a local disk
    assert {n.split("/")[0] for n in files(bucket)} == {
        "models",
        "clt.safetensors",
        "prompts.txt",
        "graphs",
        "global",
    }
    after = snapshot(cluster)
    caches = [cwd for cwd, names in after.items() if "pyspark-safetensors-remote" in names]
    assert caches  # the executors fetched the model and the CLT from the bucket
    assert_nothing_local(before, after)

    # the CLI replaces it whole with two prompts' graphs, on the same session
    monkeypatch.setattr(session, "local_session", lambda *a, **k: Unstopped(cluster))
    bucket.put_bytes("two.txt", b"def main():\n\n")
    argv = ["--model", config.model, "--transcoders", config.transcoders[0], "--prompts",
            f"{s3_bucket}/two.txt", "--output", config.output, "--partitions", "2",
            "--storage-option", f"endpoint_url={s3_endpoint}", "--no-browser"]  # fmt: skip
    assert cli.graphs(argv) == 0
    summary = json.loads(out.read_bytes("graphs.json"))
    assert (summary["graphs"], summary["failed"], summary["config"]["browser"]) == (1, 1, False)
    adjacency = files(out.child("adjacency"))
    pages = {"index.html", "graph.html", "data/index.js", "data/pages.js", "data/graph-0.js"}
    assert files(out) == expected_files(summary, adjacency) - pages
    assert_nothing_local(before, snapshot(cluster))


def assert_nothing_local(before: dict[str, set[str]], after: dict[str, set[str]]) -> None:
    """Nothing new but the executors' copies of the model and the CLT (each in its own
    files directory, its working directory on this master)."""
    new_tmp = after.pop("tmp") - before["tmp"]
    assert not [n for n in new_tmp if re.search(r"graphs|s3:|staging|attempt", n)]
    assert after.pop("driver") == before["driver"] == set()
    executors = {k: v for k, v in before.items() if k not in ("tmp", "driver")}
    assert set(after) == set(executors)
    for cwd, names in after.items():
        assert names - executors[cwd] <= {"pyspark-safetensors-remote"}, cwd


def _killed_after_a_graph(marker: str):
    """A ``job._graphs_fn`` whose first task attempt to write a graph dies (as a killed
    process does: no exception, no cleanup) right after it, ``marker`` made as it dies."""
    real = job._graphs_fn

    def graphs_fn(config, staging, options):
        run = real(config, staging, options)

        def flaky(batches):  # defined here: pickled by value for the executors
            import os

            from pyspark import TaskContext

            for batch in run(batches):
                yield batch
                if TaskContext.get().attemptNumber() == 0 and batch.column("files")[0].as_py():
                    try:
                        os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
                    except FileExistsError:
                        continue  # another task died already
                    os._exit(1)

        return flaky

    return graphs_fn


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_killed_attempt_leaves_no_file_in_the_output(cluster, toy, dictionaries, s3_bucket,
                                                        s3_endpoint, tmp_path, monkeypatch, where):  # fmt: skip
    marker = tmp_path / "killed"
    monkeypatch.setattr(job, "_graphs_fn", _killed_after_a_graph(str(marker)))
    options = {"endpoint_url": s3_endpoint} if where == "s3" else {}
    root = f"{s3_bucket}/runs" if where == "s3" else str(tmp_path / "runs")
    config = GraphsConfig(model=str(toy), transcoders=(str(dictionaries["clt"]),),
                          output=f"{root}/graphs", partitions=2)  # fmt: skip
    prompts = cluster.createDataFrame([(p,) for p in PROMPTS], "prompt string")
    summary = run_graphs(cluster, config, prompts, storage_options=options)
    assert marker.exists()  # an attempt did die after writing a graph
    assert (summary["graphs"], summary["failed"]) == (4, 1)
    out = DatasetLocation.of(config.output, storage_options=options)
    check_output(out, summary, len(PROMPTS))  # no file of the dead attempt, no _attempts/
    parent = DatasetLocation.of(root, storage_options=options)
    assert {n.split("/")[0] for n in files(parent)} == {"graphs"}  # no staging left


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_failed_job_leaves_the_old_output_and_a_finished_one_replaces_it(
    s3_bucket, s3_endpoint, tmp_path, where
):
    """``StagedOutput`` alone (no Spark): the old output untouched by a failure, replaced
    whole by a success (its files gone, an adopted attempt's file in place, the others'
    and the staging location deleted)."""
    from pyspark_safetensors.dataset.publish import attempt_folder, staged_output

    options = {"endpoint_url": s3_endpoint} if where == "s3" else {}
    root = f"{s3_bucket}/runs" if where == "s3" else str(tmp_path / "runs")
    parent = DatasetLocation.of(root, storage_options=options)
    out = parent.child("graphs")
    for name in ("graphs.json", "old/prompt_id=7/part-0.parquet", "index.html"):
        out.put_bytes(name, b"old")
    with (
        pytest.raises(RuntimeError, match="a task failed"),
        staged_output(out, "graphs.json") as job,
    ):
        job.staging.write_bytes(f"{attempt_folder('a')}/data/graph-0.js", b"new")
        job.staging.put_bytes("index.html", b"new")
        raise RuntimeError("a task failed")
    assert files(parent) == {f"graphs/{n}" for n in files(out)}  # no staging left
    assert {n: out.read_bytes(n) for n in files(out)} == {
        "graphs.json": b"old", "old/prompt_id=7/part-0.parquet": b"old", "index.html": b"old",
    }  # fmt: skip
    with staged_output(out, "graphs.json") as job:
        for tag in ("a", "b"):  # two attempts of one task: "b"'s rows were collected
            job.staging.write_bytes(f"{attempt_folder(tag)}/data/graph-0.js", tag.encode())
        job.adopt(f"{attempt_folder('b')}/data/graph-0.js", "data/graph-0.js")
        job.staging.put_bytes("index.html", b"new")
        job.staging.put_json("graphs.json", {"graphs": 1})
    assert {n: out.read_bytes(n) for n in files(out)} == {
        "graphs.json": b'{\n  "graphs": 1\n}\n', "data/graph-0.js": b"b", "index.html": b"new",
    }  # fmt: skip
    assert {n.split("/")[0] for n in parent.list(recursive=True)} == {"graphs"}
    assert not [n for n in out.list(recursive=True) if n.startswith("old")]


def test_a_remote_model_is_copied_once_per_version(s3_bucket, s3_endpoint, tmp_path):
    from pyspark_safetensors.dataset.fetch import local_copy

    options = {"endpoint_url": s3_endpoint}
    bucket = DatasetLocation.of(s3_bucket, storage_options=options)
    bucket.put_bytes("model/config.json", b"{}")
    bucket.put_bytes("model/sub/weights.bin", b"1234")
    cache = tmp_path / "cache"
    first = local_copy(f"{s3_bucket}/model", cache_dir=cache, storage_options=options)
    assert sorted(str(p.relative_to(first)) for p in Path(first).rglob("*") if p.is_file()) == [
        "config.json", "sub/weights.bin",
    ]  # fmt: skip
    assert local_copy(f"{s3_bucket}/model", cache_dir=cache, storage_options=options) == first
    one = local_copy(f"{s3_bucket}/model/sub/weights.bin", cache_dir=cache, storage_options=options)
    assert Path(one).read_bytes() == b"1234" and Path(one).name == "weights.bin"
    bucket.put_bytes("model/sub/weights.bin", b"12345")  # a new version: copied again
    second = local_copy(f"{s3_bucket}/model", cache_dir=cache, storage_options=options)
    assert second != first and (Path(second) / "sub" / "weights.bin").read_bytes() == b"12345"
    assert not [p for p in cache.iterdir() if p.name.endswith(".tmp")]
    assert local_copy(str(tmp_path), cache_dir=cache) == str(tmp_path)  # local: as it is
    assert local_copy(f"file://{tmp_path}", cache_dir=cache) == str(tmp_path)
    with pytest.raises(OSError, match="no such file"):
        local_copy(f"{s3_bucket}/nothing", cache_dir=cache, storage_options=options)
