"""The JVM source's streaming sink (jvm-shim, ``SafetensorsStreamingWrite``): each
micro-batch one append of the dataset, recorded in the manifest's ``stream_commits`` under
the query's id, so that a batch replayed after a restart commits nothing; rows exactly
once, read back by both readers and the reference ``safetensors`` library; output modes
other than append refused; a dataset marked ``complete`` refuses appends."""

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pyspark.sql import functions as F
from safetensors.numpy import load_file

from implementations import reader, require, writer
from pyspark_safetensors.dataset import verify_dataset
from pyspark_safetensors.spark.register import python_data_sources

pytestmark = [pytest.mark.spark]

ROWS_PER_FILE = 5


@pytest.fixture(scope="module")
def jvm(spark):
    """Skips when the session has no shim jar."""
    return require(spark, "jvm")


def add_files(folder: Path, first: int, count: int) -> None:
    """``count`` parquet files of ``ROWS_PER_FILE`` rows each (ids from file ``first`` on),
    for the file source to find."""
    folder.mkdir(exist_ok=True)
    for f in range(first, first + count):
        ids = np.arange(f * ROWS_PER_FILE, (f + 1) * ROWS_PER_FILE, dtype=np.int64)
        x = pa.array([[i * 0.5, -float(i)] for i in ids], pa.list_(pa.float32()))
        pq.write_table(pa.table({"id": ids, "x": x}), folder / f"in-{f:03d}.parquet")


def file_stream(spark, folder: Path):
    """The files of ``folder`` as a stream, one file per micro-batch."""
    return (
        spark.readStream.schema("id long, x array<float>")
        .option("maxFilesPerTrigger", 1)
        .parquet(str(folder))
    )


def rate_stream(spark, rows_per_batch=6):
    """Spark's deterministic rate source: ``value`` 0, 1, 2, ... ``rows_per_batch`` a batch."""
    return spark.readStream.format("rate-micro-batch").option("rowsPerBatch", rows_per_batch).load()


def run(df, out: Path, checkpoint: Path, *, mode="append", **options):
    """Stream ``df`` into ``out`` until its source is drained; the finished query (its
    failure raised as the StreamingQueryException)."""
    w = df.writeStream.format("safetensors").option("implementation", "jvm").outputMode(mode)
    for key, value in {"checkpointLocation": checkpoint, **options}.items():
        w = w.option(key, str(value))
    query = w.trigger(availableNow=True).start(str(out))
    query.awaitTermination()
    return query


def forget_commit(checkpoint: Path, batch: int) -> None:
    """The crash a replay follows: the sink's commit of ``batch`` landed, Spark's commit
    log entry (and its checksum file) did not."""
    for name in (str(batch), f".{batch}.crc"):
        (checkpoint / "commits" / name).unlink(missing_ok=True)


def manifest(path: Path) -> dict:
    return json.loads((path / "dataset_manifest.json").read_text())


def files_on_disk(path: Path) -> set[str]:
    """Every shard under ``path``, relative to it: the manifest must list exactly these."""
    return {p.relative_to(path).as_posix() for p in path.rglob("*.safetensors")}


def listed(path: Path) -> set[str]:
    return {s["shard_path"] for s in manifest(path)["shards"]}


def ids_by_reference_library(path: Path) -> list[int]:
    return sorted(int(i) for s in listed(path) for i in load_file(str(path / s))["id"])


def read_ids(spark, path: Path) -> dict[str, list[int]]:
    """The ids each reader finds: the JVM source, and the Python source where Spark has one."""
    implementations = ["jvm"] + (["python"] if python_data_sources() else [])
    return {
        impl: sorted(r.id for r in reader(spark, impl).load(str(path)).select("id").collect())
        for impl in implementations
    }


def test_every_row_lands_once_and_a_restart_continues_the_stream(spark, jvm, tmp_path):
    inputs, out, ck = tmp_path / "in", tmp_path / "out", tmp_path / "ck"
    add_files(inputs, 0, 3)
    first = run(file_stream(spark, inputs), out, ck, batch_size=4)
    doc = manifest(out)
    assert doc["stream_commits"] == {first.id: 2}  # three batches, the last one's id
    assert doc["total_samples"] == 15 and files_on_disk(out) == listed(out)
    assert not (out / "_temporary").exists()
    verify_dataset(str(out), checksums=True)  # the manifest schema included

    add_files(inputs, 3, 2)
    again = run(file_stream(spark, inputs), out, ck, batch_size=4)
    assert again.id == first.id and again.runId != first.runId  # the stream id is the query's
    assert manifest(out)["stream_commits"] == {first.id: 4}
    want = list(range(25))
    assert all(ids == want for ids in read_ids(spark, out).values())
    assert ids_by_reference_library(out) == want
    x = reader(spark, jvm).load(str(out)).where("id = 7").first().x
    assert x == [3.5, -7.0]

    # a batch append after the stream keeps the stream's record
    extra = spark.range(100, 104).select(
        "id", F.array(F.lit(0.0).cast("float"), F.lit(1.0).cast("float")).alias("x")
    )
    writer(extra, jvm).option("batch_size", 4).mode("append").save(str(out))
    assert manifest(out)["stream_commits"] == {first.id: 4} and manifest(out)["total_samples"] == 29


def test_a_replayed_batch_commits_nothing(spark, jvm, tmp_path):
    inputs, out, ck = tmp_path / "in", tmp_path / "out", tmp_path / "ck"
    add_files(inputs, 0, 2)
    first = run(file_stream(spark, inputs), out, ck, batch_size=4)
    before, shards = manifest(out), files_on_disk(out)
    assert before["stream_commits"] == {first.id: 1}
    forget_commit(ck, 1)
    replay = run(file_stream(spark, inputs), out, ck, batch_size=4)
    replayed = [p for p in replay.recentProgress if p["batchId"] == 1]
    assert replayed and replayed[0]["numInputRows"] == ROWS_PER_FILE  # Spark did run it again
    assert manifest(out) == before  # nothing published
    assert files_on_disk(out) == shards  # and the replay's shards deleted
    assert not (out / "_temporary").exists()
    assert ids_by_reference_library(out) == list(range(10))


def test_kv_mode_and_partition_columns(spark, jvm, tmp_path):
    rows = rate_stream(spark).select(
        F.concat(F.lit("k"), F.col("value").cast("string")).alias("key"),
        (F.col("value") % 2).cast("int").alias("p"),
        F.col("value").alias("id"),
        F.array(F.col("value").cast("float")).alias("x"),
    )
    kv = run(rows.drop("p"), tmp_path / "kv", tmp_path / "ck-kv", name_col="key")
    assert manifest(tmp_path / "kv")["stream_commits"] == {kv.id: 0}
    keys = sorted(k for s in listed(tmp_path / "kv") for k in load_file(str(tmp_path / "kv" / s)))
    assert keys == sorted(f"k{i}__{c}" for i in range(6) for c in ("id", "x"))

    part = run(
        rows.drop("key"),
        tmp_path / "part",
        tmp_path / "ck-part",
        batch_size=2,
        partition_columns="p",
    )
    root = manifest(tmp_path / "part")
    assert root["partition_columns"] == ["p"] and root["stream_commits"] == {part.id: 0}
    assert {s.split("/")[0] for s in listed(tmp_path / "part")} == {"p=0", "p=1"}
    back = reader(spark, jvm).load(str(tmp_path / "part"))
    assert sorted((r.p, r.id) for r in back.collect()) == sorted((i % 2, i) for i in range(6))
    assert ids_by_reference_library(tmp_path / "part" / "p=1") == [1, 3, 5]
    # a replay writes into the partitions' directories too: its shards go from there (this
    # source also hands the restarted query one new batch, which lands once)
    forget_commit(tmp_path / "ck-part", 0)
    again = run(
        rows.drop("key"),
        tmp_path / "part",
        tmp_path / "ck-part",
        batch_size=2,
        partition_columns="p",
    )
    batches = [p["batchId"] for p in again.recentProgress]
    assert batches[0] == 0 and manifest(tmp_path / "part")["stream_commits"] == {
        part.id: batches[-1]
    }
    ids = ids_by_reference_library(tmp_path / "part")
    assert ids == list(range(6 * len(batches)))  # batch 0's rows once
    assert files_on_disk(tmp_path / "part") == listed(tmp_path / "part")


def test_update_and_complete_output_modes_are_refused(spark, jvm, tmp_path):
    counts = (
        rate_stream(spark).groupBy((F.col("value") % 2).alias("k")).agg(F.count("*").alias("n"))
    )
    with pytest.raises(Exception, match=r"outputMode\('complete'\) would rewrite the dataset"):
        run(counts, tmp_path / "c", tmp_path / "ck-c", mode="complete", batch_size=2)
    with pytest.raises(Exception, match="safetensors does not support Update mode"):
        run(counts, tmp_path / "u", tmp_path / "ck-u", mode="update", batch_size=2)
    assert not (tmp_path / "c" / "dataset_manifest.json").exists()
    rows = spark.readStream.format("rate").load().selectExpr("array(CAST(value AS FLOAT)) AS x")
    w = (
        rows.writeStream.format("safetensors")
        .option("implementation", "jvm")
        .option("batch_size", 2)
    )
    continuous = w.option("checkpointLocation", str(tmp_path / "ck-r")).trigger(
        continuous="1 second"
    )
    with pytest.raises(Exception, match="the continuous trigger is not supported"):
        continuous.start(str(tmp_path / "r")).awaitTermination(60)


def test_a_complete_dataset_refuses_appends_and_a_failed_batch_leaves_nothing(spark, jvm, tmp_path):
    inputs, out, ck = tmp_path / "in", tmp_path / "out", tmp_path / "ck"
    add_files(inputs, 0, 1)
    run(file_stream(spark, inputs), out, ck, batch_size=4)
    doc = manifest(out)
    # a batch whose rows disagree on x's shape fails after its first shard is written;
    # abort deletes what its tasks wrote
    x = pa.array([[1.0, 2.0]] * 4 + [[3.0]] * 2, pa.list_(pa.float32()))
    pq.write_table(pa.table({"id": np.arange(90, 96), "x": x}), inputs / "in-bad.parquet")
    with pytest.raises(Exception, match="shape"):
        run(file_stream(spark, inputs), out, ck, batch_size=4)
    assert manifest(out) == doc and files_on_disk(out) == listed(out)
    assert not (out / "_temporary").exists()  # the batch's lease went too

    (out / "dataset_manifest.json").write_text(json.dumps({**doc, "complete": True}))
    shutil.rmtree(ck)
    with pytest.raises(Exception, match="is marked complete"):
        run(file_stream(spark, inputs), out, ck, batch_size=4)
    extra = spark.range(1).select(
        "id", F.array(F.lit(0.0).cast("float"), F.lit(1.0).cast("float")).alias("x")
    )
    with pytest.raises(Exception, match="is marked complete"):
        writer(extra, jvm).option("batch_size", 4).mode("append").save(str(out))
    writer(extra, jvm).option("batch_size", 4).mode("overwrite").save(str(out))  # an overwrite may
    assert "complete" not in manifest(out) and manifest(out)["total_samples"] == 1


@pytest.mark.parametrize("impl", ["jvm", pytest.param("python", marks=pytest.mark.python_source)])
def test_a_stream_id_is_refused_under_another_checkpoint(spark, tmp_path, impl):
    """Both sinks take ``stream_id`` and record the checkpoint with the stream's batches:
    under a new checkpoint Spark numbers the batches from 0 again, and a reused stream id
    would drop every one as a replay (a file stream of 15 rows, then the same files under
    another checkpoint: the dataset kept 15 rows and the query ended without an error)."""
    require(spark, impl)
    inputs, out, a, b = tmp_path / "in", tmp_path / "out", tmp_path / "ckA", tmp_path / "ckB"
    add_files(inputs, 0, 3)
    run(file_stream(spark, inputs), out, a, implementation=impl, stream_id="s1", batch_size=4)
    assert manifest(out)["stream_commits"] == {"s1": 2}
    assert manifest(out)["stream_checkpoints"] == {"s1": f"file:{a}"}
    with pytest.raises(Exception, match="committed its batches up to 2 from checkpoint"):
        run(file_stream(spark, inputs), out, b, implementation=impl, stream_id="s1", batch_size=4)
    assert manifest(out)["total_samples"] == 15 and files_on_disk(out) == listed(out)
    add_files(inputs, 3, 1)  # its own checkpoint continues the stream
    run(file_stream(spark, inputs), out, a, implementation=impl, stream_id="s1", batch_size=4)
    assert manifest(out)["stream_commits"] == {"s1": 3}
    assert ids_by_reference_library(out) == list(range(20))
