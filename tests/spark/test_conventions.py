"""Spark's conventions for file sources, as the safetensors source follows (or refuses)
them: append checked on the driver, no empty directory after a failed first write,
several paths and manifest paths in ``load``, partitioning and catalog tables refused."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.fs as pafs
import pyspark
import pytest
from pyspark.sql import functions as F

from implementations import IMPLEMENTATIONS, require, writer
from pyspark_safetensors.spark.options import IMPLEMENTATION_CONF

pytestmark = pytest.mark.spark

BOOM = "computed although the append was refused"


@pytest.fixture(params=IMPLEMENTATIONS)
def implementation(request, spark):
    """Each writer in turn: the Python source and the JVM one (skipped without the jar)."""
    return require(spark, request.param)


def write(df, path, mode="overwrite", implementation=None, **options):
    w = df.write.format("safetensors").mode(mode)
    if implementation:
        w = w.option("implementation", implementation)
    for k, v in options.items():
        w = w.option(k, v)
    w.save(str(path))


def frame(spark, n=4, dim=3):
    return spark.range(n, numPartitions=2).select(
        F.col("id"),
        F.array(*[(F.col("id") + j).cast("float") for j in range(dim)]).alias("vec"),
        F.col("id").cast("string").alias("key"),
    )


def exploding(df):
    """``df`` whose every row fails when computed: an error from it proves a task ran."""
    first = df.columns[0]
    fail = F.raise_error(F.lit(BOOM))
    return df.withColumn(first, F.when(F.spark_partition_id() >= 0, fail).otherwise(F.col(first)))


def files(path) -> list[str]:
    return sorted(p.name for p in Path(path).iterdir())


# ------------------------------------------------------------ append, checked on the driver


@pytest.mark.parametrize(
    ("change", "options", "message"),
    [
        (
            lambda df: df.withColumn("id", F.col("id").cast("int")),
            {},
            r"column 'id' is I64\[\] in one part and I32\[\]",
        ),
        (
            lambda df: df,
            {"dtype": '{"vec": "F16"}'},
            r"column 'vec' is F32\[3\] in one part and F16\[3\]",
        ),
        (lambda df: df.drop("id"), {}, r"appended columns \['vec'\] differ .*missing \['id'\]"),
        (
            lambda df: df.withColumn("vec", F.array(F.col("vec"))),
            {},
            r"column 'vec' is F32\[3\] in one part and F32\[-1, -1\]",
        ),
        (lambda df: df, {"batch_size": "3"}, r"batch_size is 2, this write's is 3"),
        (
            lambda df: df,
            {"shapes": '{"vec": [3, 1]}'},
            r"column 'vec' is F32\[3\] in one part and F32\[3, 1\]",
        ),
    ],
    ids=["dtype", "dtype-option", "missing-column", "rank", "batch_size", "shapes"],
)
def test_batch_append_is_refused_before_any_task(
    spark, tmp_path, implementation, change, options, message
):
    out = tmp_path / "ds"
    write(frame(spark).select("id", "vec"), out, batch_size=2)
    before = files(out)
    df = exploding(change(frame(spark).select("id", "vec")))
    with pytest.raises(Exception, match=message) as caught:
        write(df, out, "append", implementation, **{"batch_size": "2", **options})
    assert BOOM not in str(caught.value)
    assert files(out) == before


def test_kv_append_settings_are_checked_before_any_task(spark, tmp_path, implementation):
    out = tmp_path / "kv"
    write(frame(spark).select("key", "vec"), out, name_col="key")
    before = files(out)
    renamed = frame(spark).select(F.col("key").alias("name"), "vec")
    for df, options, message in [
        (renamed, {"name_col": "name"}, "name_col is 'key', this write's is 'name'"),
        (
            frame(spark).select("key", "vec"),
            {"name_col": "key", "kv_separator": "::"},
            "kv_separator is '__'",
        ),
        (
            frame(spark).select("key", "vec"),
            {"batch_size": "2", "columns": "vec"},
            "cannot append batch-mode data to a kv-mode",
        ),
    ]:
        with pytest.raises(Exception, match=message) as caught:
            write(exploding(df), out, "append", implementation, **options)
        assert BOOM not in str(caught.value)
    assert files(out) == before


def test_compatible_appends_pass_the_driver_check(spark, tmp_path, implementation):
    # KV rows of other lengths, and batch arrays whose length the type leaves open: the
    # driver lets them through; the commit still checks what the tasks wrote.
    kv = tmp_path / "kv"
    write(frame(spark).select("key", "vec"), kv, name_col="key")
    longer = frame(spark, dim=5).select(F.concat(F.lit("b"), "key").alias("key"), "vec")
    write(longer, kv, "append", implementation, name_col="key")
    manifest = json.loads((kv / "dataset_manifest.json").read_text())
    assert manifest["total_samples"] == 8 and manifest["schema"]["vec"]["sample_shape"] == [-1]
    batch = tmp_path / "batch"
    write(frame(spark).select("vec"), batch, batch_size=2)
    with pytest.raises(Exception, match=r"column 'vec' is F32\[3\] in one part and F32\[5\]"):
        write(frame(spark, dim=5).select("vec"), batch, "append", implementation, batch_size=2)
    write(frame(spark).select("vec"), batch, "append", implementation, batch_size=2)
    assert spark.read.format("safetensors").load(str(batch)).count() == 8


# ------------------------------------------------------------ a failed first write leaves nothing


def test_failed_write_into_a_new_path_leaves_no_directory(spark, tmp_path, implementation):
    failing = exploding(frame(spark).select("id", "vec"))
    new = tmp_path / "new" / "ds"
    with pytest.raises(Exception, match=BOOM):
        write(failing, new, "overwrite", implementation, batch_size=2)
    assert not new.exists()
    existing = tmp_path / "existing"
    existing.mkdir()
    with pytest.raises(Exception, match=BOOM):
        write(failing, existing, "overwrite", implementation, batch_size=2)
    assert existing.is_dir() and files(existing) == []  # it was there before: it stays


@pytest.mark.python_source
def test_failed_write_into_a_new_prefix_leaves_no_object(spark, s3_bucket, s3_endpoint):
    uri = f"{s3_bucket}/new/ds"
    w = exploding(frame(spark).select("id", "vec")).write.format("safetensors").mode("overwrite")
    with pytest.raises(Exception, match=BOOM):
        w.option("batch_size", 2).option("endpoint_url", s3_endpoint).save(uri)
    scheme, _, host = s3_endpoint.partition("://")
    fs = pafs.S3FileSystem(endpoint_override=host, scheme=scheme)
    bucket = s3_bucket.removeprefix("s3://")
    left = fs.get_file_info(pafs.FileSelector(bucket, recursive=True))
    # the failed job's last task may still be deleting its own shard: wait for it briefly
    import time

    deadline = time.monotonic() + 30
    while [
        i.path for i in left if i.path.startswith(f"{bucket}/new/ds")
    ] and time.monotonic() < deadline:
        time.sleep(0.3)
        left = fs.get_file_info(pafs.FileSelector(bucket, recursive=True))
    assert [i.path for i in left if i.path.startswith(f"{bucket}/new/ds")] == []


# ------------------------------------------------------------ load: several paths, manifests, files


def test_several_paths_read_as_one_dataframe(spark, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    write(frame(spark, n=4).select("id", "vec"), a, batch_size=2)
    write(
        frame(spark, n=3).withColumn("id", F.col("id") + 100).select("id", "vec"), b, batch_size=2
    )
    df = spark.read.format("safetensors").load([str(a), str(b / "dataset_manifest.json")])
    assert sorted(r.id for r in df.collect()) == [0, 1, 2, 3, 100, 101, 102]
    row = df.where("id = 101").first()
    assert row.vec == [1.0, 2.0, 3.0]
    kv_a, kv_b = tmp_path / "kv_a", tmp_path / "kv_b"
    write(frame(spark).select("key", "vec"), kv_a, name_col="key")
    write(
        frame(spark).select(F.concat(F.lit("b"), "key").alias("key"), "vec"), kv_b, name_col="key"
    )
    keys = spark.read.format("safetensors").load([str(kv_a), str(kv_b)]).select("key").collect()
    assert sorted(r.key for r in keys) == ["0", "1", "2", "3", "b0", "b1", "b2", "b3"]


def test_several_paths_of_different_schemas_are_refused(spark, tmp_path):
    a, b, kv = tmp_path / "a", tmp_path / "b", tmp_path / "kv"
    write(frame(spark).select("id", "vec"), a, batch_size=2)
    write(frame(spark).select(F.col("id").cast("int").alias("id"), "vec"), b, batch_size=2)
    write(frame(spark).select("key", "vec"), kv, name_col="key")
    reader = spark.read.format("safetensors")
    with pytest.raises(
        Exception, match=r"column 'id' is bigint in '.*a' and int in '.*b'.*unionByName"
    ):
        reader.load([str(a), str(b)])
    with pytest.raises(Exception, match=r"read as view=rows, '.*kv' as view=kv"):
        reader.load([str(a), str(kv)])


def test_manifest_path_reads_its_dataset(spark, tmp_path):
    out = tmp_path / "ds"
    write(frame(spark).select("id", "vec"), out, batch_size=2)
    df = spark.read.format("safetensors").load(str(out / "dataset_manifest.json"))
    assert sorted(r.id for r in df.collect()) == [0, 1, 2, 3]


def test_other_files_are_refused_when_loaded_not_in_a_task(spark, tmp_path):
    out = tmp_path / "ds"
    write(frame(spark).select("key", "vec"), out, name_col="key")
    index = out / "_tensor_index.parquet" / "part-00000.parquet"
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ")
    reader = spark.read.format("safetensors")
    # .load() itself raises: the schema is inferred on the driver, before any task
    with pytest.raises(
        Exception, match=r"is a file but neither a \.safetensors file nor a dataset's"
    ) as caught:
        reader.load(str(index))
    assert "Executor" not in str(caught.value)
    with pytest.raises(Exception, match=r"broken\.safetensors") as caught:
        reader.load(str(broken))
    assert "Executor" not in str(caught.value)


# ------------------------------------------------------------ partitioning and catalog tables


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_bucket_by_is_refused_and_partition_by_needs_the_jvm_source(spark, tmp_path, impl):
    df = frame(spark).select("id", "vec")
    out = tmp_path / "p"
    w = writer(df, require(spark, impl)).mode("overwrite").option("batch_size", 2)
    if impl == "python":  # the JVM source says so where the jar is, else Spark refuses first
        with pytest.raises(
            Exception,
            match=r"Python source cannot write a partitioned dataset|partitioning or clustering "
            r"columns do not match",
        ):
            w.partitionBy("id").save(str(out))
    with pytest.raises(Exception, match="does not support bucketBy"):
        w.bucketBy(2, "id").save(str(out))
    assert not out.exists()  # partitions themselves: tests/spark/test_partitions.py


@pytest.mark.skipif(
    pyspark.__version__ < "4", reason="Spark 3.5's session catalog refuses the write first"
)
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_catalog_tables_through_the_jvm_source_and_the_python_sources_refusal(
    spark, tmp_path, impl
):
    # a catalog write sees the session's conf, not the option: the conf picks the source
    spark.conf.set(IMPLEMENTATION_CONF, require(spark, impl))
    try:
        df = frame(spark).select("id", "vec")
        w = df.write.format("safetensors").mode("overwrite").option("batch_size", 2)
        out = tmp_path / "t"
        if impl == "python":  # Spark hands a Python source no path from a catalog table
            with pytest.raises(
                Exception,
                match=r"saveAsTable.*hand no path to a Python data source.*"
                r"write the dataset with \.save\(path\)",
            ):
                w.saveAsTable("conventions_managed")
            w.option("path", str(out)).saveAsTable("conventions_with_path")
            assert spark.read.format("safetensors").load(str(out)).count() == 4
            with pytest.raises(Exception, match=r"A catalog table .* hands no path.*load\(path\)"):
                spark.table("conventions_with_path").collect()
        else:  # the JVM source takes the table's location: managed and external tables
            w.saveAsTable("conventions_managed")
            w.option("path", str(out)).saveAsTable("conventions_with_path")
            for table in ("conventions_managed", "conventions_with_path"):
                assert sorted(r.id for r in spark.table(table).collect()) == [0, 1, 2, 3]
            assert spark.read.format("safetensors").load(str(out)).count() == 4
    finally:
        spark.conf.unset(IMPLEMENTATION_CONF)
        spark.sql("DROP TABLE IF EXISTS conventions_with_path")
        spark.sql("DROP TABLE IF EXISTS conventions_managed")
