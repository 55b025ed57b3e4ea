"""Executors in separate JVMs (master ``local-cluster[2,1,1024]``, each with its own Python
workers) writing to the loopback S3 server and to a local path, while every task's first
attempt fails: each sample lands exactly once and nothing stray is left. The local path is
written by both writers (the JVM one cannot reach ``s3://`` without hadoop-aws).

The retry tests live here, in the one shared session that retries tasks: the others fail
a task at its first error, so a test of bad input does not wait for four attempts."""

import numpy as np
import pyarrow.fs as pafs
import pytest
from pyspark.sql import functions as F
from pyspark.sql.types import LongType
from safetensors.numpy import load_file

from implementations import jvm_available, writer
from pyspark_safetensors.dataset import MANIFEST, DatasetLocation, verify_dataset
from pyspark_safetensors.spark.register import python_data_sources
from pyspark_safetensors.torch import open_dataset

pytestmark = pytest.mark.spark


@pytest.fixture(scope="module")
def cluster():
    from spark_sessions import spark_session

    return spark_session("cluster")


def test_retried_tasks_on_separate_executors(cluster, tmp_path, s3_bucket, s3_endpoint):
    def first_attempt_fails(x):  # defined here: pickled by value for the executors
        from pyspark import TaskContext

        if TaskContext.get().attemptNumber() == 0:
            raise RuntimeError("first attempt of every task fails")
        return x

    flaky = F.udf(first_attempt_fails, LongType())
    df = cluster.range(0, 300, numPartitions=4).select(
        flaky("id").alias("id"),
        F.array(*[(F.col("id") + j / 10).cast("float") for j in range(3)]).alias("vec"),
    )
    cases = []
    if python_data_sources():
        cases += [
            (f"{s3_bucket}/acts", {"endpoint_url": s3_endpoint}),
            (str(tmp_path / "acts"), {"implementation": "python"}),
        ]
    if jvm_available(cluster):
        cases.append((str(tmp_path / "acts-jvm"), {"implementation": "jvm"}))
    for path, options in cases:
        w = df.write.format("safetensors").option("batch_size", 32).mode("overwrite")
        for k, v in options.items():
            w = w.option(k, v)
        w.save(path)
        storage = {k: v for k, v in options.items() if k != "implementation"}
        loc = DatasetLocation.of(path, storage_options=storage)
        manifest = verify_dataset(loc, checksums=True)
        names = sorted(
            n for n, i in loc.list(recursive=True).items() if i.type == pafs.FileType.File
        )
        listed = sorted(s.shard_path for s in manifest.shards)
        assert names == sorted([*listed, MANIFEST, "_SUCCESS"])  # failed attempts left nothing
        ds = open_dataset(path, storage_options=storage or None)
        ids = sorted(ds[i]["id"].item() for i in range(len(ds)))
        assert ids == list(range(300))
        back = (
            cluster.read.format("safetensors").options(**options).load(path).select("id").collect()
        )
        assert sorted(r.id for r in back) == list(range(300))


def test_partitioned_write_with_a_killed_task_commits_once(cluster, tmp_path):
    """The JVM source's partitioned write, a task's Python worker killed mid-write (its
    first attempt): every partition lists each sample exactly once, as its own dataset and
    through the root, and no file of the killed attempt is left."""
    if not jvm_available(cluster):
        pytest.skip("no JVM source on the class path (build it with jvm-shim/build.sh)")

    killed = tmp_path / "killed"

    def killed_once(x):  # defined here: pickled by value for the executors
        import os

        from pyspark import TaskContext

        context = TaskContext.get()
        if context.attemptNumber() == 0 and context.partitionId() == 1 and x % 50 == 7:
            killed.touch()
            os._exit(1)  # the worker dies as a killed process does: no exception, no cleanup
        return x

    flaky = F.udf(killed_once, LongType())
    df = cluster.range(0, 200, numPartitions=4).select(
        flaky("id").alias("id"),
        (F.col("id") % 3).cast("int").alias("layer"),
        F.array(*[(F.col("id") + j / 10).cast("float") for j in range(3)]).alias("vec"),
    )
    out = tmp_path / "parts"
    df.write.format("safetensors").option("implementation", "jvm").option(
        "batch_size", 16
    ).partitionBy("layer").mode("overwrite").save(str(out))
    assert killed.exists()  # the first attempt did die
    root = verify_dataset(out, checksums=True)
    assert root.partition_columns == ("layer",)
    loc = DatasetLocation.of(str(out))
    files = sorted(n for n, i in loc.list(recursive=True).items() if i.type == pafs.FileType.File)
    per_partition = [f"layer={k}/{name}" for k in range(3) for name in (MANIFEST, "_SUCCESS")]
    assert files == sorted(
        [*(s.shard_path for s in root.shards), MANIFEST, "_SUCCESS", *per_partition]
    )
    for k in range(3):
        ds = open_dataset(out / f"layer={k}")
        assert sorted(ds[i]["id"].item() for i in range(len(ds))) == list(range(k, 200, 3))
    back = cluster.read.format("safetensors").load(str(out)).select("id", "layer").collect()
    assert sorted((r.id, r.layer) for r in back) == [(i, i % 3) for i in range(200)]


def test_a_retried_task_that_had_written_shards_leaves_every_sample_once(cluster, tmp_path):
    """A task's first attempt fails after it has written part of its output: the retry's
    shards alone are committed, and no file of the failed attempt is left."""
    from pyspark import TaskContext

    def flaky(batches):
        context = TaskContext.get()
        for i, batch in enumerate(batches):
            yield batch
            if i == 1 and context.attemptNumber() == 0:
                raise RuntimeError("injected failure after two batches")

    df = cluster.range(4000, numPartitions=2).select(F.array(F.col("id").cast("float")).alias("v"))
    df = df.mapInArrow(flaky, df.schema)
    implementations = (["python"] if python_data_sources() else []) + (
        ["jvm"] if jvm_available(cluster) else []
    )
    cluster.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "500")
    try:
        for implementation in implementations:
            out = tmp_path / implementation
            writer(df, implementation).option("batch_size", 100).mode("overwrite").save(str(out))
            manifest = verify_dataset(out)
            shards = sorted(out.glob("*.safetensors"))
            values = np.concatenate([load_file(f)["v"][:, 0] for f in shards])
            assert sorted(values.tolist()) == list(range(4000)), implementation
            assert {f.name for f in shards} == {s.shard_path for s in manifest.shards}
            assert not (out / "_temporary").exists()
    finally:
        cluster.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")
