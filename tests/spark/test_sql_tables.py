"""Catalog tables through the JVM source, in Spark's session catalog and in a Hive
metastore (embedded Derby): the SQL of docs/sql.md, statement by statement, on batch and
KV datasets; and the tensor index as a directory Spark's parquet reader reads."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from pyspark.sql import functions as F
from safetensors.numpy import load_file

from implementations import jvm_available, require, writer

pytestmark = pytest.mark.spark


@pytest.fixture(scope="module", params=["in-memory", "hive"])
def catalog(request):
    """A session whose catalog is Spark's in-memory one, then one backed by a Hive
    metastore; the JVM source answers (the test is skipped without the jar)."""
    from spark_sessions import spark_session

    spark = spark_session("local" if request.param == "in-memory" else "hive")
    require(spark, "jvm")
    assert spark.conf.get("spark.sql.catalogImplementation") == request.param
    return spark


@pytest.fixture
def sql(catalog):
    """``sql(statement)``: run it and collect; tables made by the test are dropped after."""
    made = []

    def run(statement: str):
        words = statement.split()
        if words[0] == "CREATE":
            made.append(words[2])
        return catalog.sql(statement).collect()

    yield run
    for table in made:
        catalog.sql(f"DROP TABLE IF EXISTS {table}")


def frame(spark, start: int, n: int):
    return spark.range(start, start + n, numPartitions=2).select(
        F.col("id"),
        F.concat(F.lit("k"), F.col("id").cast("string")).alias("key"),
        F.array(*((F.col("id") + i).cast("float") for i in range(3))).alias("vec"),
    )


def dataset(spark, path: Path, mode: str, n: int = 6) -> str:
    """A dataset written with save(): batch (``id, vec`` in batches of 2, vec as F16) or
    KV (``vec`` keyed by ``key``)."""
    df = frame(spark, 0, n)
    if mode == "batch":
        w = writer(df.select("id", "vec"), "jvm").option("batch_size", 2)
        w = w.option("dtype", json.dumps({"vec": "F16"}))
    else:
        w = writer(df.select("key", "vec"), "jvm").option("name_col", "key")
    w.mode("overwrite").save(str(path))
    return str(path)


def manifest(path) -> dict:
    return json.loads((Path(path) / "dataset_manifest.json").read_text())


def snapshot(path) -> dict[str, bytes]:
    root = Path(path)
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def vectors(rows) -> dict:
    return {r[0]: list(r[1]) for r in rows}


@pytest.mark.catalog_tables
@pytest.mark.parametrize("mode", ["batch", "kv"])
def test_a_table_over_a_dataset_every_statement(catalog, sql, tmp_path, mode):
    path = dataset(catalog, tmp_path / "ds", mode)
    key = "id" if mode == "batch" else "key"
    sql(f"CREATE TABLE acts_{mode} USING safetensors LOCATION '{path}'")
    t = f"acts_{mode}"

    # the schema comes from the manifest, the key column first in a KV table
    described = [(r.col_name, r.data_type) for r in sql(f"DESCRIBE {t}")]
    assert described[:2] == [
        (key, "bigint" if mode == "batch" else "string"),
        ("vec", "array<float>"),
    ]
    rows = vectors(sql(f"SELECT {key}, vec FROM {t}"))
    first = 0 if mode == "batch" else "k0"
    assert len(rows) == 6 and rows[first] == [0.0, 1.0, 2.0]
    extended = {r.col_name: r.data_type for r in sql(f"DESCRIBE EXTENDED {t}")}
    assert extended["Provider"] == "safetensors" and extended["Location"].endswith("/ds")
    assert extended["Type"] == "EXTERNAL"
    shown = sql(f"SHOW CREATE TABLE {t}")[0][0]
    assert "USING safetensors" in shown and "LOCATION" in shown

    # INSERT brings no options: the dataset's own settings (batch size, dtype, key) hold
    new = "SELECT 100 AS id, array(1.5f, 2.5f, 3.5f) AS vec"
    if mode == "kv":
        new = "SELECT 'k100' AS key, array(1.5f, 2.5f, 3.5f) AS vec"
    sql(f"INSERT INTO {t} {new}")
    m = manifest(path)
    assert m["total_samples"] == 7
    if mode == "batch":
        assert m["batch_size"] == 2 and m["schema"]["vec"]["dtype"] == "F16"
    else:
        assert m["name_col"] == "key" and m["kv_separator"] == "__"
    assert sql(f"SELECT count(*) FROM {t}")[0][0] == 7

    # another writer appends; REFRESH TABLE shows its rows
    more = frame(catalog, 200, 3).select(key, "vec")
    w = writer(more, "jvm").mode("append")
    if mode == "batch":
        w = w.option("batch_size", 2).option("dtype", json.dumps({"vec": "F16"}))
    else:
        w = w.option("name_col", "key")
    w.save(path)
    sql(f"REFRESH TABLE {t}")
    assert sql(f"SELECT count(*) FROM {t}")[0][0] == 10

    # INSERT OVERWRITE: one commit, only the new generation's shards left
    sql(f"INSERT OVERWRITE {t} SELECT * FROM {t} WHERE vec[0] < 3")
    m = manifest(path)
    assert sorted(p.name for p in Path(path).glob("*.safetensors")) == sorted(
        s["shard_path"] for s in m["shards"]
    )
    assert sorted(vectors(sql(f"SELECT {key}, vec FROM {t}"))) == sorted(
        [0, 1, 2, 100] if mode == "batch" else ["k0", "k1", "k100", "k2"]
    )

    # DROP TABLE of an external table keeps the data
    sql(f"DROP TABLE {t}")
    assert catalog.read.format("safetensors").load(path).count() == 4


@pytest.mark.catalog_tables
def test_ctas_save_as_table_and_managed_tables(catalog, sql, tmp_path):
    src = frame(catalog, 0, 6).select("id", "vec")
    src.createOrReplaceTempView("ctas_source")
    # CTAS: its OPTIONS are the table's; the dataset lives in the warehouse
    sql(
        "CREATE TABLE ctas_t USING safetensors "
        """OPTIONS (batch_size 3, dtype '{"vec": "F16"}') AS SELECT * FROM ctas_source"""
    )
    described = {r.col_name: r.data_type for r in sql("DESCRIBE EXTENDED ctas_t")}
    assert described["Type"] == "MANAGED"
    root = Path(described["Location"].removeprefix("file:"))
    m = manifest(root)
    assert m["batch_size"] == 3 and m["schema"]["vec"]["dtype"] == "F16"
    sql("INSERT INTO ctas_t SELECT * FROM ctas_source")
    assert manifest(root)["batch_size"] == 3
    assert sql("SELECT count(*) FROM ctas_t")[0][0] == 12

    # saveAsTable: overwrite, the same cell again, append; a contradiction refused
    w = src.write.format("safetensors").option("batch_size", 2)
    w.mode("overwrite").saveAsTable("saved_t")
    w.mode("overwrite").saveAsTable("saved_t")
    assert catalog.table("saved_t").count() == 6
    w.mode("append").saveAsTable("saved_t")
    assert catalog.table("saved_t").count() == 12
    with pytest.raises(Exception, match=r"the dataset's batch_size is 2, this write's is 5"):
        src.write.format("safetensors").option("batch_size", 5).mode("append").saveAsTable(
            "saved_t"
        )
    assert catalog.table("saved_t").count() == 12
    saved = Path(
        next(
            r.data_type for r in sql("DESCRIBE EXTENDED saved_t") if r.col_name == "Location"
        ).removeprefix("file:")
    )
    assert (saved / "dataset_manifest.json").is_file()

    # DROP TABLE of a managed table deletes its data
    sql("DROP TABLE saved_t")
    sql("DROP TABLE ctas_t")
    assert not saved.exists() and not root.exists()


@pytest.mark.catalog_tables
def test_a_failed_insert_leaves_the_table_as_it_was(catalog, sql, tmp_path):
    path = dataset(catalog, tmp_path / "ds", "batch")
    sql(f"CREATE TABLE failing USING safetensors LOCATION '{path}'")
    before = snapshot(path)
    with pytest.raises(Exception, match="insert failed in a task"):
        sql(
            "INSERT INTO failing SELECT id, IF(id = 7, raise_error('insert failed in a task'), "
            "array(1f, 2f, 3f)) AS vec FROM range(0, 10, 1, 2)"
        )
    assert snapshot(path) == before
    assert sql("SELECT count(*) FROM failing")[0][0] == 6


@pytest.mark.parametrize("implementation", ["python", "jvm"])
def test_tensor_index_is_a_directory_spark_reads(spark, tmp_path, implementation):
    require(spark, implementation)
    out = tmp_path / "kv"
    df = frame(spark, 0, 5).select("key", "vec")
    writer(df, implementation).option("name_col", "key").mode("overwrite").save(str(out))
    index = out / "_tensor_index.parquet"
    assert index.is_dir() and [p.name for p in index.iterdir()] == ["part-00000.parquet"]
    rows = spark.read.parquet(str(index)).select("tensor_key", "file_name").collect()
    assert sorted(r.tensor_key for r in rows) == [f"k{i}__vec" for i in range(5)]
    # the rows route each key to the shard holding it; plain pyarrow reads the directory
    for r in rows:
        assert r.tensor_key in load_file(str(out / r.file_name))
    assert pq.read_table(index).num_rows == 5
    # an append replaces the part; the manifest's own index is the same bytes
    writer(frame(spark, 5, 2).select("key", "vec"), implementation).option("name_col", "key").mode(
        "append"
    ).save(str(out))
    assert spark.read.parquet(str(index)).count() == 7
    assert (index / "part-00000.parquet").read_bytes() == (
        out / manifest(out)["index_file"]
    ).read_bytes()


@pytest.mark.python_source
def test_an_index_file_of_earlier_versions_gives_way_to_the_directory(spark, tmp_path):
    from pyspark_safetensors.torch import open_dataset

    out = tmp_path / "kv"
    df = frame(spark, 0, 3).select("key", "vec")
    writer(df, "python").option("name_col", "key").mode("overwrite").save(str(out))
    # the layout written before: the manifest names one index file of the spec's name
    index = out / "_tensor_index.parquet"
    m = manifest(out)
    (out / m["index_file"]).unlink()
    part = index / "part-00000.parquet"
    data = part.read_bytes()
    part.unlink()
    index.rmdir()
    index.write_bytes(data)
    m["index_file"] = "_tensor_index.parquet"
    (out / "dataset_manifest.json").write_text(json.dumps(m))
    assert open_dataset(str(out)).get("k1", "vec").tolist() == [1.0, 2.0, 3.0]
    for implementation in ("python", "jvm"):
        if implementation == "jvm" and not jvm_available(spark):
            continue
        rows = (
            spark.read.format("safetensors").option("implementation", implementation).load(str(out))
        )
        assert rows.count() == 3
    writer(frame(spark, 3, 1).select("key", "vec"), "python").option("name_col", "key").mode(
        "append"
    ).save(str(out))
    assert index.is_dir() and pq.read_table(index).num_rows == 4
    assert open_dataset(str(out)).get("k3", "vec").tolist() == [3.0, 4.0, 5.0]
