"""The Python reader's partitions and its ``index`` view: counts, keys, shapes and dtypes of
a dataset without its tensor bytes (from the manifest and the tensor index; shards whose
bytes are destroyed after writing still answer), the same answers as the full read."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from pyspark.sql import functions as F

# every test here is of the Python source, which Spark 3.5 lacks (its reader module too)
pytest.importorskip("pyspark.sql.datasource", reason="Spark 3.5 has no Python data sources")

from implementations import reader, writer
from pyspark_safetensors.dataset import write_batch_dataset
from pyspark_safetensors.spark.reader import cut_rows, pack

pytestmark = pytest.mark.spark


def load(spark, path, **options):
    return reader(spark, "python").options(**options).load(str(path))


def shards(path) -> list[Path]:
    return sorted(Path(path).glob("*.safetensors"))


def zero_out(path, keep_header: bool = False) -> None:
    """Every shard of a dataset overwritten with zeros, its size kept (the manifest's size
    check still passes); ``keep_header`` keeps each header and zeroes only the tensor bytes."""
    for shard in shards(path):
        data = shard.read_bytes()
        keep = 8 + int.from_bytes(data[:8], "little") if keep_header else 0
        shard.write_bytes(data[:keep] + bytes(len(data) - keep))


def test_pack_splits_evenly_and_keeps_heavy_items_alone():
    assert pack([10] * 20, 100) == [list(range(10)), list(range(10, 20))]
    assert pack([10, 10, 10, 300], 128) == [[0, 1, 2], [3]]
    assert pack([5, 5], 128) == [[0, 1]]
    assert pack([], 128) == []


def test_cut_rows_spans_shards_and_keeps_empty_ones():
    assert cut_rows([4, 0, 4, 2], 5) == [((0, 0, 4), (1, 0, 0), (2, 0, 1)), ((2, 1, 4), (3, 0, 2))]
    assert cut_rows([3], 10) == [((0, 0, 3),)]


def test_small_shards_are_packed_unless_rows_per_partition_is_given(spark, tmp_path):
    x = np.arange(60, dtype=np.float32).reshape(20, 3)
    write_batch_dataset(tmp_path / "ds", {"x": x}, rows_per_shard=2)
    packed = load(spark, tmp_path / "ds")
    assert packed.rdd.getNumPartitions() == 1
    assert sorted(r.x for r in packed.collect()) == x.tolist()
    ranges = load(spark, tmp_path / "ds", rows_per_partition=1)
    assert ranges.rdd.getNumPartitions() == 20
    assert sorted(r.x for r in ranges.collect()) == x.tolist()


def test_index_view_of_a_batch_dataset_reads_no_shard(spark, tmp_path):
    path = tmp_path / "ds"
    x = np.arange(60, dtype=np.float32).reshape(10, 2, 3)
    write_batch_dataset(path, {"x": x, "id": np.arange(10, dtype=np.int64)}, rows_per_shard=4)
    assert load(spark, path).count() == 10
    files = [str(s) for s in shards(path)]
    zero_out(path)  # headers and bytes gone: only the manifest is left to answer
    with pytest.raises(Exception, match="header"):
        load(spark, path).collect()

    index = load(spark, path, view="index")
    assert index.columns == ["file", "row", "x", "id"]
    assert index.count() == 10
    index.createOrReplaceTempView("ds_index")
    assert spark.sql("SELECT count(*) AS n FROM ds_index").first().n == 10
    rows = index.collect()
    assert sorted((r.file, r.row) for r in rows) == [
        (f, i) for f, n in zip(files, (4, 4, 2), strict=True) for i in range(n)
    ]
    assert {(r.x.dtype, tuple(r.x.shape), r.id.dtype, tuple(r.id.shape)) for r in rows} == {
        ("F32", (2, 3), "I64", ())
    }


@pytest.mark.parametrize("generate_index", ["true", "false"])
def test_index_view_of_a_kv_dataset_gives_the_kv_views_answers(spark, tmp_path, generate_index):
    # keys whose tensor names sort otherwise than the keys ("a!__v" before "a__v"), ragged
    # shapes, two columns interleaved in the file
    df = spark.createDataFrame(
        [("a", [1.0], 1), ("a!", [1.0, 2.0], 2), ("b", [], 3), ("c", [4.0, 5.0, 6.0], 4)],
        "k string, v array<float>, n int",
    )
    path = tmp_path / "kv"
    writer(df.repartition(2), "python").option("name_col", "k").option(
        "generate_index", generate_index
    ).mode("overwrite").save(str(path))
    full = load(spark, path)
    assert sorted((r.k, r.v, r.n) for r in full.collect()) == sorted(
        (k, v, n) for k, v, n in df.collect()
    )
    expected = sorted((r.k, len(r.v)) for r in full.collect())
    # with an index no shard is opened; without one only headers are read
    zero_out(path, keep_header=generate_index == "false")

    index = load(spark, path, view="index")
    assert index.columns == ["k", "file", "row", "v", "n"]
    assert index.count() == 4
    rows = index.collect()
    assert sorted((r.k, r.v.shape[0]) for r in rows) == expected
    assert {(r.v.dtype, r.n.dtype, tuple(r.n.shape)) for r in rows} == {("F32", "I32", ())}
    assert {r.file for r in rows} == {str(s) for s in shards(path)}
    assert index.where(F.col("k") == "a!").select("k").collect()[0].k == "a!"


def test_index_view_needs_a_dataset(spark, tmp_path):
    path = tmp_path / "one.safetensors"
    header = json.dumps({"t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    header += b" " * (-len(header) % 8)
    path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(4))
    with pytest.raises(Exception, match="view='index' needs a dataset directory"):
        load(spark, path, view="index").collect()


def test_a_kv_read_takes_each_shards_tensors_from_the_index(spark, tmp_path):
    # With a tensor index the KV view parses no header: headers blanked to spaces (their
    # length kept) still read, and an index of one-row groups is read group by group.
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pyspark_safetensors.dataset import load_manifest, read_index, read_shard_index

    df = spark.createDataFrame(
        [(str(i), [float(i)] * (1 + i % 3), i) for i in range(12)],
        "k string, v array<float>, n int",
    )
    path = tmp_path / "kv"
    writer(df.repartition(2), "python").option("name_col", "k").mode("overwrite").save(str(path))
    expected = sorted((r.k, r.v, r.n) for r in df.collect())
    manifest = load_manifest(path)
    whole = read_index(path, manifest)
    sink = pa.BufferOutputStream()
    pq.write_table(whole, sink, row_group_size=1)
    (path / manifest.index_file).write_bytes(sink.getvalue().to_pybytes())
    for entry in manifest.shards:
        one = read_shard_index(path, manifest, entry.shard_path)
        assert one.equals(whole.filter(pa.compute.equal(whole["file_name"], entry.shard_path)))
    for shard in shards(path):
        data = bytearray(shard.read_bytes())
        n = int.from_bytes(data[:8], "little")
        data[8 : 8 + n] = b" " * n
        shard.write_bytes(bytes(data))
    assert sorted((r.k, r.v, r.n) for r in load(spark, path).collect()) == expected


def test_a_kv_index_that_points_into_a_header_is_refused(spark, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pyspark_safetensors.dataset import load_manifest, read_index

    df = spark.createDataFrame([("a", [1.0]), ("b", [2.0])], "k string, v array<float>")
    path = tmp_path / "kv"
    writer(df.coalesce(1), "python").option("name_col", "k").mode("overwrite").save(str(path))
    manifest = load_manifest(path)
    table = read_index(path, manifest)
    table = table.set_column(4, "begin", pa.array([0] * table.num_rows, pa.int64()))
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    (path / manifest.index_file).write_bytes(sink.getvalue().to_pybytes())
    with pytest.raises(Exception, match="point into the shard's header"):
        load(spark, path).collect()
