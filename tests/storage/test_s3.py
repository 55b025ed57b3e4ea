"""Datasets on an S3 server (moto, on loopback): the Spark writer and both readers give
exactly what a local path gives; append, overwrite, failures, verify and inspect."""

import json
import subprocess
import sys
import time

import pyarrow.fs as pafs
import pytest
import torch
from pyspark.sql import functions as F

from pyspark_safetensors.dataset import MANIFEST, DatasetLocation, load_manifest
from pyspark_safetensors.torch import open_dataset

# s3:// through pyarrow: the Python source's (the JVM source reaches stores through Hadoop)
pytestmark = [pytest.mark.spark, pytest.mark.python_source]


def frame(spark, n=40, parts=3):
    return spark.range(n, numPartitions=parts).select(
        F.col("id"),
        F.array(*[(F.col("id") * 10 + j).cast("float") for j in range(4)]).alias("vec"),
        F.concat(F.lit("doc__"), F.col("id").cast("string")).alias("key"),
    )


def write(df, path, endpoint=None, mode="overwrite", **options):
    w = df.write.format("safetensors").mode(mode)
    if endpoint:
        w = w.option("endpoint_url", endpoint)
    for k, v in options.items():
        w = w.option(k, v)
    w.save(str(path))


def read(spark, path, endpoint=None, **options):
    r = spark.read.format("safetensors")
    if endpoint:
        r = r.option("endpoint_url", endpoint)
    for k, v in options.items():
        r = r.option(k, v)
    return r.load(str(path))


def listing(uri, endpoint):
    loc = DatasetLocation.of(uri, storage_options={"endpoint_url": endpoint})
    return sorted(n for n, i in loc.list(recursive=True).items() if i.type == pafs.FileType.File)


def rows(df, by):
    return [r.asDict(recursive=True) for r in df.orderBy(by).collect()]


def test_batch_write_and_reads_equal_local(spark, tmp_path, s3_bucket, s3_endpoint):
    uri = f"{s3_bucket}/acts"
    df = frame(spark).select("id", "vec")
    write(df, tmp_path / "acts", batch_size=7)
    write(df, uri.replace("s3://", "s3a://"), s3_endpoint, batch_size=7)  # the Hadoop spelling
    m = load_manifest(DatasetLocation.of(uri, storage_options={"endpoint_url": s3_endpoint}))
    assert m.total_samples == 40 and m.commit_id
    # only the manifest's shards, the manifest and _SUCCESS: no staging objects, no renames
    assert listing(uri, s3_endpoint) == sorted(
        [*(s.shard_path for s in m.shards), MANIFEST, "_SUCCESS"]
    )
    assert rows(read(spark, uri, s3_endpoint), "id") == rows(read(spark, tmp_path / "acts"), "id")
    # the torch reader, through the environment's endpoint as users configure it
    remote = open_dataset(uri, checksums=True, storage_options={"endpoint_url": s3_endpoint})
    local = open_dataset(tmp_path / "acts")
    assert len(remote) == len(local) == 40
    for i in (0, 6, 7, 39):
        for k, v in local[i].items():
            assert torch.equal(remote[i][k], v)
    env = {"AWS_ENDPOINT_URL": s3_endpoint}
    assert verify_dataset_with_env(uri, env) == m.total_samples
    out = run_cli(["inspect", uri], env)
    assert "batch dataset, 40 samples" in out and "vec: F32 sample shape [4]" in out
    assert "whole (" in run_cli(["verify", uri], env)


def verify_dataset_with_env(uri, env):
    code = (
        "import sys; from pyspark_safetensors.dataset import verify_dataset; "
        "print(verify_dataset(sys.argv[1], checksums=True).total_samples)"
    )
    return int(run([sys.executable, "-c", code, uri], env).strip())


def run_cli(args, env):
    return run([sys.executable, "-m", "pyspark_safetensors.cli", *args], env)


def run(cmd, env):
    import os

    done = subprocess.run(
        cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_kv_names_with_separators_round_trip(spark, tmp_path, s3_bucket, s3_endpoint):
    """Keys and a column containing the separator: the writer and both readers agree."""
    uri = f"{s3_bucket}/kv"
    df = frame(spark, n=12).select("key", F.col("vec").alias("my__col"), "id")
    for path, endpoint in ((tmp_path / "kv", None), (uri, s3_endpoint)):
        write(df, path, endpoint, name_col="key")
        got = rows(read(spark, path, endpoint), "key")
        assert [r["key"] for r in got] == sorted(f"doc__{i}" for i in range(12))
        assert all(r["my__col"] == [r["id"] * 10.0 + j for j in range(4)] for r in got)
        ds = open_dataset(path, storage_options={"endpoint_url": endpoint} if endpoint else None)
        assert sorted(ds.keys()) == sorted(f"doc__{i}" for i in range(12))
        assert ds.get("doc__3", "my__col").tolist() == [30.0, 31.0, 32.0, 33.0]
        assert ds.get("doc__3")["id"].item() == 3


def test_append_overwrite_and_failed_job(spark, s3_bucket, s3_endpoint):
    uri = f"{s3_bucket}/ao"
    opts = {"storage_options": {"endpoint_url": s3_endpoint}}
    df = frame(spark, n=10, parts=2).select("id", "vec")
    write(df, uri, s3_endpoint, batch_size=4)
    first = open_dataset(uri, **opts)
    write(df, uri, s3_endpoint, mode="append", batch_size=4)
    ids = sorted(r.id for r in read(spark, uri, s3_endpoint).collect())
    assert ids == sorted(list(range(10)) * 2)
    # overwrite: the replaced generation is deleted at the commit point
    write(frame(spark, n=3, parts=1).select("id", "vec"), uri, s3_endpoint, batch_size=4)
    assert sorted(r.id for r in read(spark, uri, s3_endpoint).collect()) == [0, 1, 2]
    with pytest.raises(Exception, match="was replaced or deleted after it was opened"):
        first[9]
    before = listing(uri, s3_endpoint)
    # a job whose tasks fail leaves no object of its own (and the dataset as it was)
    bad = df.withColumn(
        "vec", F.when(F.col("id") == 7, F.raise_error(F.lit("boom"))).otherwise(F.col("vec"))
    )
    with pytest.raises(Exception, match="boom"):
        write(bad, uri, s3_endpoint, mode="append", batch_size=4)
    # Spark returns once the job is aborted; a sibling task may still be finishing its
    # last shard, which it deletes itself when it finds the job's lease gone
    deadline = time.monotonic() + 60
    while listing(uri, s3_endpoint) != before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert listing(uri, s3_endpoint) == before
    assert (
        json.loads(
            DatasetLocation.of(uri, storage_options={"endpoint_url": s3_endpoint}).read_bytes(
                MANIFEST
            )
        )["total_samples"]
        == 3
    )


def test_bad_uri_and_options_are_clear(spark, tmp_path, s3_endpoint):
    with pytest.raises(Exception, match="needs a bucket"):
        write(frame(spark, n=2).select("vec"), "s3://", s3_endpoint, batch_size=2)
    with pytest.raises(Exception, match="storage option path_style='maybe'"):
        write(
            frame(spark, n=2).select("vec"),
            "s3://b/x",
            s3_endpoint,
            batch_size=2,
            path_style="maybe",
        )
