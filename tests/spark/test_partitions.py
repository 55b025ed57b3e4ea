"""Partitioned datasets through the JVM source (``partitionBy``): Hive-style directories,
each a dataset of its own; the root's manifest as the one commit point; partition columns
and pruning on read; dynamic and conditional overwrite; KV datasets; and what the Python
source and the Python readers say of a partitioned root."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from pyspark.sql import functions as F

from implementations import require, writer
from pyspark_safetensors.cli import main as cli
from pyspark_safetensors.dataset import PartitionedDatasetError, verify_dataset
from pyspark_safetensors.dataset.layout import partition_dir
from pyspark_safetensors.torch import open_dataset

pytestmark = pytest.mark.spark


@pytest.fixture(scope="module")
def spark():
    from spark_sessions import spark_session

    session = spark_session("local")
    require(session, "jvm")
    return session


def frame(spark, layers, n_per_layer: int = 5, offset: float = 0.0):
    """``layer`` (int), ``id`` and ``vec`` (3 floats), rows of every layer interleaved over
    two tasks, as a real job's are."""
    n = len(layers) * n_per_layer
    layer = F.element_at(F.array(*map(F.lit, layers)), (F.col("id") % len(layers) + 1).cast("int"))
    return spark.range(0, n, numPartitions=2).select(
        layer.alias("layer"),
        F.col("id"),
        F.array(*((F.col("id") + i + offset).cast("float") for i in range(3))).alias("vec"),
    )


def save(df, path, mode="overwrite", *partition_by, **options):
    w = writer(df, "jvm").option("batch_size", 2).mode(mode)
    for k, v in options.items():
        w = w.option(k, v)
    if partition_by:
        w = w.partitionBy(*partition_by)
    w.save(str(path))


def manifest(path) -> dict:
    return json.loads((Path(path) / "dataset_manifest.json").read_text())


def snapshot(path) -> dict[str, bytes]:
    root = Path(path)
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def rows(spark, path, where=None):
    df = spark.read.format("safetensors").load(str(path))
    if where is not None:
        df = df.where(where)
    return sorted((r.layer, r.id, [round(x, 3) for x in r.vec]) for r in df.collect())


def test_layout_each_partition_a_dataset(spark, tmp_path, capsys):
    out = tmp_path / "acts"
    save(frame(spark, [0, 1, 2]), out, "overwrite", "layer", generate_index="true")
    root = manifest(out)
    assert root["partition_columns"] == ["layer"]
    index = pq.read_table(out / "_tensor_index.parquet").to_pydict()
    assert {name.split("/")[0] for name in index["file_name"]} == {"layer=0", "layer=1", "layer=2"}
    assert {s["shard_path"].split("/")[0] for s in root["shards"]} == {
        "layer=0",
        "layer=1",
        "layer=2",
    }
    assert root["total_samples"] == 15
    for layer in range(3):
        part = out / f"layer={layer}"
        own = manifest(part)
        assert "partition_columns" not in own and own["commit_id"] == root["commit_id"]
        assert (part / "_SUCCESS").exists()
        # its own index, its shards named as in its own manifest
        own_index = pq.read_table(part / "_tensor_index.parquet").to_pydict()
        assert set(own_index["file_name"]) == {s["shard_path"] for s in own["shards"]}
        # every shard the root lists under the directory, and no other, by its own name
        assert sorted(s["shard_path"] for s in own["shards"]) == sorted(
            s["shard_path"].split("/", 1)[1]
            for s in root["shards"]
            if s["shard_path"].startswith(f"layer={layer}/")
        )
        ds = open_dataset(part)
        assert sorted(ds[i]["id"].item() for i in range(len(ds))) == list(range(layer, 15, 3))
        assert cli(["verify", str(part)]) == 0
    assert verify_dataset(out).partition_columns == ("layer",)
    capsys.readouterr()
    assert cli(["inspect", str(out)]) == 0 and cli(["inspect", str(out / "layer=1")]) == 0
    printed = capsys.readouterr().out
    assert "partitioned by ['layer']: 3 partitions" in printed
    assert "batch dataset, 5 samples" in printed  # the partition alone
    with pytest.raises(PartitionedDatasetError, match=r"partitioned by \['layer'\].*layer=0"):
        open_dataset(out)

    df = spark.read.format("safetensors").load(str(out))
    assert [(f.name, f.dataType.simpleString()) for f in df.schema.fields] == [
        ("id", "bigint"),
        ("vec", "array<float>"),
        ("layer", "int"),
    ]
    assert df.count() == 15
    assert rows(spark, out) == sorted((i % 3, i, [i, i + 1, i + 2]) for i in range(15))
    # the columnar reader and the row reader add the same values
    assert sorted(r.layer for r in df.select("layer", "vec").collect()) == sorted(
        r.layer for r in df.select("layer").collect()
    )
    assert df.where("layer = 1").count() == 5


def test_a_filtered_read_never_opens_another_partition(spark, tmp_path):
    out = tmp_path / "acts"
    save(frame(spark, [0, 1, 2]), out, "overwrite", "layer")
    shard = next((out / "layer=2").glob("part-*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[8:16] = b"\xff" * 8  # the header is no longer JSON; the size is unchanged
    shard.write_bytes(bytes(data))

    assert rows(spark, out, "layer = 1") == [(1, i, [i, i + 1, i + 2]) for i in range(1, 15, 3)]
    assert len(rows(spark, out, "layer < 2 AND id > 3")) == 7
    assert len(rows(spark, out, F.col("layer").isin(0, 1))) == 10
    # count() comes from the manifests: the spoiled shard is never opened
    assert spark.read.format("safetensors").load(str(out)).count() == 15
    for where in (None, "layer = 2", "id = 2"):
        with pytest.raises(Exception, match=r"layer=2/part-"):
            rows(spark, out, where)


def test_overwrite_static_dynamic_and_by_condition(spark, tmp_path):
    out = tmp_path / "acts"
    save(frame(spark, [0, 1, 2]), out, "overwrite", "layer")
    before = snapshot(out / "layer=0")

    # dynamic: only the partitions written are replaced; the others keep every byte
    save(
        frame(spark, [1, 3], offset=100),
        out,
        "overwrite",
        "layer",
        partitionOverwriteMode="dynamic",
    )
    assert snapshot(out / "layer=0") == before
    got = rows(spark, out)
    assert {layer for layer, _, _ in got} == {0, 1, 2, 3}
    assert all(vec[0] >= 100 for layer, _, vec in got if layer in (1, 3))
    assert sum(layer == 1 for layer, _, _ in got) == 5  # replaced, not appended to

    # the session's conf says the same
    spark.conf.set("spark.sql.sources.partitionOverwriteMode", "dynamic")
    try:
        save(frame(spark, [2], offset=200), out, "overwrite", "layer")
    finally:
        spark.conf.unset("spark.sql.sources.partitionOverwriteMode")
    assert sorted({layer for layer, _, _ in rows(spark, out)}) == [0, 1, 2, 3]

    # static (the default): the dataset is replaced; the dropped partitions' directories go
    save(frame(spark, [5]), out, "overwrite", "layer")
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["layer=5"]
    assert {layer for layer, _, _ in rows(spark, out)} == {5}


def test_appends_and_what_is_refused(spark, tmp_path):
    out = tmp_path / "acts"
    save(frame(spark, [0, 1]), out, "overwrite", "layer")
    # an append that names no partition columns takes the dataset's
    save(frame(spark, [1, 2], offset=50), out, "append")
    got = rows(spark, out)
    assert [sum(layer == k for layer, _, _ in got) for k in range(3)] == [5, 10, 5]
    assert manifest(out)["partition_columns"] == ["layer"]

    with pytest.raises(
        Exception, match=r"partitioned by \['layer'\], this write is partitioned by \['id'\]"
    ):
        save(frame(spark, [0]).withColumn("id", F.col("id") % 2), out, "append", "id")
    plain = tmp_path / "plain"
    save(frame(spark, [0]).drop("layer"), plain)
    with pytest.raises(
        Exception, match=r"is not partitioned, this write is partitioned by \['layer'\]"
    ):
        save(frame(spark, [0]), plain, "append", "layer")
    with pytest.raises(Exception, match=r"partition column 'vec' has type array<float>"):
        save(frame(spark, [0]), tmp_path / "bad", "overwrite", "vec")
    assert not (tmp_path / "bad").exists()


def test_a_failed_write_changes_no_partition(spark, tmp_path):
    out = tmp_path / "acts"
    save(frame(spark, [0, 1]), out, "overwrite", "layer")
    before = snapshot(out)
    failing = frame(spark, [1, 2, 3]).withColumn(
        "id", F.when(F.col("id") == 13, F.raise_error(F.lit("a task fails"))).otherwise(F.col("id"))
    )
    with pytest.raises(Exception, match="a task fails"):
        save(failing, out, "append", "layer")
    assert snapshot(out) == before
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["layer=0", "layer=1"]


def test_kv_partitions_with_values_that_need_escaping(spark, tmp_path):
    out = tmp_path / "kv"
    df = spark.createDataFrame(
        [
            ("k0", "a/b", [1.0, 2.0]),
            ("k1", "a/b", [3.0]),
            ("k0", None, [4.0]),
            ("k0", "x=y", [5.0]),
        ],
        "key string, hook string, vec array<float>",
    )
    writer(df, "jvm").option("name_col", "key").partitionBy("hook").mode("overwrite").save(str(out))
    dirs = sorted(p.name for p in out.iterdir() if p.is_dir() and p.name.startswith("hook="))
    assert dirs == ["hook=__HIVE_DEFAULT_PARTITION__", "hook=a%2Fb", "hook=x%3Dy"]
    assert dirs == sorted(partition_dir("hook", v) for v in (None, "a/b", "x=y"))  # the Python twin
    back = spark.read.format("safetensors").load(str(out))
    assert back.schema.fieldNames() == ["key", "vec", "hook"]
    got = sorted((r.hook or "", r.key, list(r.vec)) for r in back.collect())
    assert got == [
        ("", "k0", [4.0]),
        ("a/b", "k0", [1.0, 2.0]),
        ("a/b", "k1", [3.0]),
        ("x=y", "k0", [5.0]),
    ]
    # a key repeats across partitions, never within one
    assert [r.key for r in back.where("hook = 'a/b' AND key = 'k1'").collect()] == ["k1"]
    assert back.where(F.col("hook").isNull()).count() == 1
    ds = open_dataset(out / "hook=a%2Fb")
    assert sorted(ds.keys()) == ["k0", "k1"]


@pytest.mark.catalog_tables
def test_catalog_table_partitioned_by(spark, tmp_path):
    out = tmp_path / "table"
    frame(spark, [0, 1, 2]).createOrReplaceTempView("source_rows")
    try:
        spark.sql(
            f"CREATE TABLE parts USING safetensors PARTITIONED BY (layer) "
            f"OPTIONS (batch_size 2) LOCATION '{out}' AS SELECT id, vec, layer FROM source_rows"
        )
        assert manifest(out)["partition_columns"] == ["layer"]
        assert spark.sql("SELECT count(*) FROM parts WHERE layer = 2").first()[0] == 5
        spark.sql(
            "INSERT OVERWRITE parts PARTITION (layer = 1) SELECT id + 100, vec FROM source_rows WHERE layer = 1"
        )
        ids = {r.layer: sorted(x.id for x in spark.sql(f"SELECT id FROM parts WHERE layer = {r.layer}").collect())
               for r in spark.sql("SELECT DISTINCT layer FROM parts").collect()}  # fmt: skip
        assert ids[1] == [i + 100 for i in range(1, 15, 3)] and ids[0] == list(range(0, 15, 3))
        spark.sql("INSERT INTO parts SELECT id, vec, 7 FROM source_rows WHERE layer = 0")
        assert spark.sql("SELECT count(*) FROM parts WHERE layer = 7").first()[0] == 5
        # saveAsTable with partitionBy: a managed table, partitioned the same way
        w = writer(spark.table("source_rows"), "jvm").option("batch_size", 2).partitionBy("layer")
        w.mode("overwrite").saveAsTable("parts_saved")
        w.mode("append").saveAsTable("parts_saved")
        saved = spark.table("parts_saved")
        assert saved.count() == 30 and saved.where("layer = 1").count() == 10
        location = spark.sql("DESCRIBE EXTENDED parts_saved").where("col_name = 'Location'")
        assert manifest(location.first().data_type.removeprefix("file:"))["partition_columns"] == [
            "layer"
        ]
    finally:
        spark.sql("DROP TABLE IF EXISTS parts")
        spark.sql("DROP TABLE IF EXISTS parts_saved")


def test_python_readers_and_writer_say_what_works(spark, tmp_path):
    from pyspark_safetensors.spark.register import python_data_sources

    out = tmp_path / "acts"
    save(frame(spark, [0, 1]), out, "overwrite", "layer")
    if python_data_sources():
        with pytest.raises(
            Exception, match=r"Python source cannot write a partitioned dataset.*implementation=jvm"
        ):
            save_python = (
                writer(frame(spark, [0]), "python").option("batch_size", 2).partitionBy("layer")
            )
            save_python.mode("overwrite").save(str(tmp_path / "python"))
        with pytest.raises(
            Exception, match=r"partitioned by \['layer'\]: the Python source reads one partition"
        ):
            spark.read.format("safetensors").option("implementation", "python").load(
                str(out)
            ).collect()
        with pytest.raises(
            Exception, match=r"is partitioned by \['layer'\], this write is not partitioned"
        ):
            save_python = writer(frame(spark, [0]).drop("layer"), "python").option("batch_size", 2)
            save_python.mode("append").save(str(out))
