"""Structured Streaming through the Python source: the sink (rate and file sources in,
each micro-batch one append, exactly once across restarts and replays, append mode only)
and the source (the rows of each commit, once). Every query runs ``availableNow`` or
``processAllAvailable`` on tiny data; the kill-and-restart soak is ``test_stream_soak.py``."""

import json
from pathlib import Path

import numpy as np
import pytest
from pyspark.sql import functions as F
from pyspark.sql.utils import StreamingQueryException
from safetensors.numpy import load_file

from pyspark_safetensors.dataset import load_manifest

pytestmark = [pytest.mark.spark, pytest.mark.python_source]


@pytest.fixture(scope="module")
def spark():
    from spark_sessions import spark_session

    return spark_session("local")


def sink(df, checkpoint, **options):
    writer = df.writeStream.format("safetensors").option("implementation", "python")
    for k, v in {"checkpointLocation": str(checkpoint), **options}.items():
        writer = writer.option(k, str(v))
    return writer


def run_available(df, out, checkpoint, **options):
    """One run of the query over what its source has now; returns the query."""
    q = sink(df, checkpoint, **options).trigger(availableNow=True).start(str(out))
    q.awaitTermination(300)
    assert q.exception() is None, q.exception()
    return q


def rate(spark, rows_per_batch=12):
    """Spark's deterministic rate source: batch b holds values b*n .. b*n + n - 1."""
    return (
        spark.readStream.format("rate-micro-batch")
        .option("rowsPerBatch", rows_per_batch)
        .load()
        .select(
            F.col("value").alias("id"),
            F.array(F.col("value").cast("float"), (F.col("value") / 2).cast("float")).alias("x"),
        )
    )


def ids_in_shards(out: Path) -> list[int]:
    """Every ``id`` of every listed shard, read with the reference safetensors library."""
    manifest = load_manifest(out)
    return sorted(int(i) for s in manifest.shards for i in load_file(str(out / s.shard_path))["id"])


def test_rate_source_into_the_sink_exactly_once_across_restarts_and_a_replay(spark, tmp_path):
    out, ck = tmp_path / "ds", tmp_path / "ck"
    q = run_available(rate(spark), out, ck, batch_size=5)
    first = load_manifest(out)
    assert first.stream_commits == {q.id: 0} and first.total_samples == 12
    tensors = load_file(str(out / first.shards[0].shard_path))
    assert tensors["x"].dtype == np.float32 and tensors["x"].shape[1:] == (2,)
    # a restart from the checkpoint: the same stream id, the next batch
    q2 = run_available(rate(spark), out, ck, batch_size=5)
    assert q2.id == q.id and load_manifest(out).stream_commits == {q.id: 1}
    # Spark replays batch 1 when its commit log entry is missing (a driver that died
    # between the sink's commit and the log's): the sink publishes it once
    for name in ("1", ".1.crc"):
        (ck / "commits" / name).unlink()
    run_available(rate(spark), out, ck, batch_size=5)
    last = load_manifest(out)
    assert last.stream_commits[q.id] >= 1
    assert ids_in_shards(out) == list(range(last.total_samples))
    rows = spark.read.format("safetensors").option("implementation", "python").load(str(out))
    got = rows.select("id", "x").orderBy("id").collect()
    assert [r.id for r in got] == list(range(last.total_samples))
    assert got[7].x == [7.0, 3.5]


def test_file_source_into_the_sink_in_kv_mode(spark, tmp_path):
    inbox, out = tmp_path / "in", tmp_path / "ds"
    inbox.mkdir()
    for f in range(2):
        rows = [{"key": f"s{f}-{i}", "emb": [float(f), float(i), 1.0]} for i in range(3)]
        (inbox / f"{f}.json").write_text("\n".join(json.dumps(r) for r in rows))
    df = (
        spark.readStream.schema("key string, emb array<float>")
        .option("maxFilesPerTrigger", 1)
        .json(str(inbox))
    )
    q = run_available(df, out, tmp_path / "ck", name_col="key", dtype="F16")
    manifest = load_manifest(out)
    assert manifest.mode == "kv" and manifest.stream_commits == {q.id: 1}  # one batch per file
    tensors = {}
    for s in manifest.shards:
        tensors |= load_file(str(out / s.shard_path))
    assert sorted(tensors) == sorted(f"s{f}-{i}__emb" for f in range(2) for i in range(3))
    assert tensors["s1-2__emb"].dtype == np.float16 and list(tensors["s1-2__emb"]) == [1, 2, 1]
    kv = spark.read.format("safetensors").option("implementation", "python").load(str(out))
    assert kv.count() == 6


def test_output_modes_other_than_append_are_refused(spark, tmp_path):
    counts = rate(spark).groupBy((F.col("id") % 3).alias("k")).count()
    q = sink(counts, tmp_path / "ck1", batch_size=2).outputMode("complete").start(str(tmp_path))
    with pytest.raises(StreamingQueryException, match="output mode 'append' only"):
        q.awaitTermination(300)
    with pytest.raises(Exception, match="does not support Update mode"):
        q = sink(counts, tmp_path / "ck2", batch_size=2).outputMode("update").start(str(tmp_path))
        q.awaitTermination(300)
    assert not (tmp_path / "dataset_manifest.json").exists()


def test_a_stream_reads_every_committed_row_once_while_another_writer_appends(spark, tmp_path):
    out = tmp_path / "ds"

    def append(start, n):
        df = spark.range(start, start + n).select(
            F.col("id"), F.array(F.col("id").cast("float")).alias("x")
        )
        (
            df.write.format("safetensors")
            .option("implementation", "python")
            .option("batch_size", 3)
            .mode("append")
            .save(str(out))
        )

    append(0, 7)
    stream = (
        spark.readStream.format("safetensors").option("implementation", "python").load(str(out))
    )
    q = (
        stream.writeStream.format("memory")
        .queryName("followed")
        .option("checkpointLocation", str(tmp_path / "ck"))
        .start()
    )
    try:
        q.processAllAvailable()
        assert sorted(r.id for r in spark.table("followed").collect()) == list(range(7))
        append(7, 5)
        q.processAllAvailable()
        got = spark.table("followed").collect()
    finally:
        q.stop()
    assert sorted(r.id for r in got) == list(range(12))
    assert {tuple(r.x) for r in got if r.id == 9} == {(9.0,)}


def test_a_stream_source_refuses_loose_files(spark, tmp_path):
    from safetensors.numpy import save_file

    save_file({"a": np.zeros(2, np.float32)}, str(tmp_path / "one.safetensors"))
    with pytest.raises(Exception, match="a stream reads one dataset"):
        spark.readStream.format("safetensors").option("implementation", "python").load(
            str(tmp_path / "one.safetensors")
        ).writeStream.format("memory").queryName("nope").start().processAllAvailable()


def test_offsets_are_positions_in_the_shard_list_and_an_overwrite_stops_the_stream(tmp_path):
    from pyspark_safetensors.dataset import DatasetBuilder
    from pyspark_safetensors.spark.reader import plan_read
    from pyspark_safetensors.spark.stream import SafetensorsStreamReader, StreamError

    out = tmp_path / "ds"

    def append(start, n, overwrite=False):
        with DatasetBuilder(out, batch_size=4, overwrite=overwrite) as build:
            for a in range(start, start + n, 4):  # a shard per 4 rows
                m = min(4, start + n - a)
                build.add_batch({"id": np.arange(a, a + m), "x": np.ones((m, 2), np.float32)})

    def rows(reader, start, end):
        parts = reader.partitions(start, end)
        return sorted(i for p in parts for b in reader.read(p) for i in b.column("id").to_pylist())

    append(0, 6)  # two shards
    plan = plan_read({"path": str(out)})
    reader = SafetensorsStreamReader(plan, plan.schema)
    start, first = reader.initialOffset(), reader.latestOffset()
    assert (
        start == {"shards": 0} and first["shards"] == 2 and first["last"].endswith(".safetensors")
    )
    assert rows(reader, start, first) == list(range(6))
    append(6, 3)
    second = reader.latestOffset()
    assert second["shards"] == 3 and rows(reader, first, second) == [6, 7, 8]
    assert reader.latestOffset() == second  # nothing new: the same offset
    append(0, 12, overwrite=True)  # as many shards as the offsets count, others
    with pytest.raises(StreamError, match="overwritten or rewritten under this stream"):
        reader.partitions(first, second)


def _read_limits() -> bool:
    """Spark 4.2 and newer hand Python stream readers a ReadLimit."""
    try:
        from pyspark.sql.streaming.datasource import ReadMaxFiles  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _read_limits(), reason="Spark before 4.2: no ReadLimit")
@pytest.mark.parametrize(
    "option, value, batches",
    [("maxFilesPerTrigger", 3, [6, 6, 6, 2]), ("maxRowsPerTrigger", 9, [8, 8, 4]),
     ("maxRowsPerTrigger", 1, [2] * 10), (None, None, [20])],
)  # fmt: skip
def test_a_stream_reads_at_most_the_limit_of_shards_or_rows_a_micro_batch(
    spark, tmp_path, option, value, batches
):
    """Ten shards of 2 rows, read by micro-batches under a ReadLimit: whole shards, at
    least one a batch; an availableNow query keeps the limit."""
    out = tmp_path / "ds"
    for start in range(0, 20, 4):
        df = spark.range(start, start + 4, numPartitions=1)
        df = df.select("id", F.array(F.col("id").cast("float")).alias("x"))
        df.write.format("safetensors").option("implementation", "python").option(
            "batch_size", 2
        ).mode("append").save(str(out))
    assert [s.samples_count for s in load_manifest(str(out)).shards] == [2] * 10
    reader = spark.readStream.format("safetensors").option("implementation", "python")
    if option:
        reader = reader.option(option, value)
    q = (
        reader.load(str(out))
        .writeStream.format("memory")
        .queryName(f"limited_{len(batches)}_{value}")
        .option("checkpointLocation", str(tmp_path / "ck"))
        .trigger(availableNow=True)
        .start()
    )
    q.awaitTermination()
    assert [p["numInputRows"] for p in q.recentProgress if p["numInputRows"]] == batches
    got = spark.table(f"limited_{len(batches)}_{value}").collect()
    assert sorted(r.id for r in got) == list(range(20))
