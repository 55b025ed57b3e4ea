"""The JVM reader (jvm-shim, ``SafetensorsSource``) against the Python reader: for the same
dataset or files and the same options both give the same schema and the same rows; the JVM
reader prunes columns to their bytes, counts from the manifest, pushes key/name/dtype
filters, and refuses what the Python reader refuses, naming the file and the rule."""

import json
from pathlib import Path

import numpy as np
import pytest
from pyspark.sql import functions as F
from safetensors.numpy import save_file

from implementations import reader, require, writer
from pyspark_safetensors.dataset import write_batch_dataset
from pyspark_safetensors.format import to_bf16, to_f16

pytestmark = [pytest.mark.spark, pytest.mark.python_source]

PYTHON = "python"


@pytest.fixture(scope="module")
def jvm(spark):
    """The JVM reader's implementation name; skips when the session's jar lacks it."""
    return require(spark, "jvm")


def load(spark, fmt, path, **options):
    return reader(spark, fmt).options(**{k: str(v) for k, v in options.items()}).load(str(path))


def same(spark, jvm, path, **options):
    """Both readers' DataFrames, checked to have one schema and the same rows."""
    a, b = load(spark, PYTHON, path, **options), load(spark, jvm, path, **options)
    assert a.schema == b.schema
    rows_a, rows_b = sorted(map(repr, a.collect())), sorted(map(repr, b.collect()))
    assert rows_a == rows_b
    return b


@pytest.fixture(scope="module")
def every_dtype(tmp_path_factory):
    """A batch dataset with one column per readable dtype, vector and scalar, in 3 shards."""
    out = tmp_path_factory.mktemp("dtypes") / "ds"
    x = np.linspace(-3, 3, 40, dtype=np.float32).reshape(10, 4)
    cols = {
        "f32": x,
        "f64": x.astype(np.float64),
        "f16": to_f16(x),
        "bf16": to_bf16(x),
        "i8": np.arange(40, dtype=np.int8).reshape(10, 4),
        "u8": np.arange(200, 240, dtype=np.uint8).reshape(10, 4),
        "i16": np.arange(40, dtype=np.int16).reshape(10, 4),
        "u16": np.arange(65000, 65040, dtype=np.uint16).reshape(10, 4),
        "i32": np.arange(40, dtype=np.int32).reshape(10, 2, 2),
        "u32": np.arange(4294967000, 4294967040, dtype=np.uint32).reshape(10, 4),
        "i64": np.arange(10, dtype=np.int64),
    }
    write_batch_dataset(out, cols, rows_per_shard=4)
    return out


def test_rows_view_matches_for_every_dtype_and_rank(spark, jvm, every_dtype):
    df = same(spark, jvm, every_dtype)
    assert df.count() == 10
    same(spark, jvm, every_dtype, tensor_format="struct")


def test_row_ranges_split_shards_by_rows_per_partition(spark, jvm, every_dtype):
    df = same(spark, jvm, every_dtype, rows_per_partition=3)
    # 3 shards of 4, 4 and 2 rows: 2 + 2 + 1 ranges
    assert df.rdd.getNumPartitions() == 5


def test_small_shards_are_packed_into_partitions_unless_rows_per_partition_is_given(
    spark, jvm, tmp_path
):
    # 10 small shards over local[2]'s 2 cores: a few partitions, as Spark packs files
    write_batch_dataset(
        tmp_path / "ds", {"x": np.arange(80, dtype=np.float32).reshape(20, 4)}, rows_per_shard=2
    )
    packed = same(spark, jvm, tmp_path / "ds")
    assert packed.rdd.getNumPartitions() == 2
    assert sorted(r.x[0] for r in packed.collect()) == list(range(0, 80, 4))
    no_columns = load(spark, jvm, tmp_path / "ds").select(F.lit(1).alias("one")).collect()
    assert len(no_columns) == 20
    # an explicit rows_per_partition keeps its ranges, one partition each, as in Python
    ranges = same(spark, jvm, tmp_path / "ds", rows_per_partition=1)
    assert ranges.rdd.getNumPartitions() == 20


def test_kv_view_with_ragged_rows_and_key_filter(spark, jvm, tmp_path):
    df = spark.range(30).select(
        F.concat(F.lit("doc"), F.col("id").cast("string")).alias("doc"),
        F.sequence(F.lit(0), F.col("id") % 5).cast("array<float>").alias("v"),
        F.col("id").cast("int").alias("n"),
    )
    writer(df, PYTHON).option("name_col", "doc").mode("overwrite").save(str(tmp_path))
    same(spark, jvm, tmp_path)
    same(spark, jvm, tmp_path, tensor_format="struct")
    picked = load(spark, jvm, tmp_path).where(F.col("doc").isin("doc3", "doc12"))
    assert sorted((r.doc, r.n, len(r.v)) for r in picked.collect()) == [
        ("doc12", 12, 3),
        ("doc3", 3, 4),
    ]


def test_tensors_and_files_views_on_plain_files(spark, jvm, tmp_path):
    save_file(
        {"w": np.ones((2, 3), np.float32), "b": np.zeros(3, np.int64)},
        str(tmp_path / "a.safetensors"),
    )
    save_file({"w": np.full((2, 3), 2, np.float32)}, str(tmp_path / "b.safetensors"))
    same(spark, jvm, tmp_path)
    same(spark, jvm, tmp_path, include_data="false")
    same(spark, jvm, tmp_path / "a.safetensors")
    same(spark, jvm, tmp_path, view="files")
    same(spark, jvm, str(tmp_path / "*.safetensors"))
    only = load(spark, jvm, tmp_path).where((F.col("name") == "w") & (F.col("dtype") == "F32"))
    assert sorted(r.file.rsplit("/", 1)[1] for r in only.collect()) == [
        "a.safetensors",
        "b.safetensors",
    ]


def sparse_file_over_2_gib(path: Path) -> bytes:
    """A safetensors file of 2^31 + 64 bytes of data, sparse on disk: a 2^31-byte tensor
    ``big`` (zeros) and a 64-byte tensor ``small``; returns ``small``'s bytes."""
    small = np.arange(16, dtype=np.float32)
    big_n = 1 << 31
    header = {
        "big": {"dtype": "U8", "shape": [big_n], "data_offsets": [0, big_n]},
        "small": {"dtype": "F32", "shape": [16], "data_offsets": [big_n, big_n + 64]},
    }
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        f.seek(8 + len(text) + big_n)
        f.write(small.tobytes())
    return small.tobytes()


def test_a_file_over_2_gib_reads_the_tensors_asked_for(spark, jvm, tmp_path):
    """A tensor of a file over 2 GiB is read by its own range (no whole-file map, which Java
    caps at 2 GiB); a tensor over 2 GiB is listed, and refused naming the file if its bytes
    are asked for."""
    path = tmp_path / "huge.safetensors"
    small = sparse_file_over_2_gib(path)
    listed = load(spark, jvm, path, include_data="false").orderBy("name").collect()
    assert [(r.name, list(r.shape)) for r in listed] == [("big", [1 << 31]), ("small", [16])]
    picked = load(spark, jvm, path).where(F.col("name") == "small").select("data").collect()
    assert bytes(picked[0].data.data) == small
    one_column = load(spark, jvm, path, view="files").select("small").collect()
    assert bytes(one_column[0].small.data) == small
    with pytest.raises(Exception, match=r"huge\.safetensors.*over 2 GiB"):
        load(spark, jvm, path, view="files").select("big").collect()


def test_small_files_are_packed_into_partitions_as_spark_packs_its_file_sources(
    spark, jvm, tmp_path
):
    for i in range(20):
        save_file({"w": np.full((4, 4), i, np.float32)}, str(tmp_path / f"{i:02d}.safetensors"))
    size = (tmp_path / "00.safetensors").stat().st_size
    packed = load(spark, jvm, tmp_path)
    # 20 small files over local[2]'s 2 cores: about one partition per core, not 20 tasks
    assert packed.rdd.getNumPartitions() <= 3
    # every file read once, its own bytes
    firsts = sorted(np.frombuffer(r.data.data, np.float32)[0] for r in packed.collect())
    assert firsts == list(range(20))
    conf = spark.conf
    keep = (
        conf.get("spark.sql.files.maxPartitionBytes"),
        conf.get("spark.sql.files.openCostInBytes"),
    )
    try:
        # each file (its bytes plus the open cost) alone fills a partition
        conf.set("spark.sql.files.maxPartitionBytes", str(size + 1))
        conf.set("spark.sql.files.openCostInBytes", "1")
        split = load(spark, jvm, tmp_path)
        assert split.rdd.getNumPartitions() == 20
        assert split.count() == 20
    finally:
        conf.set("spark.sql.files.maxPartitionBytes", keep[0])
        conf.set("spark.sql.files.openCostInBytes", keep[1])


def test_count_reads_no_shard_and_one_column_reads_only_its_bytes(spark, jvm, tmp_path):
    out = tmp_path / "ds"
    write_batch_dataset(out, {"a": np.ones((8, 4), np.float32), "b": np.ones((8, 2), np.float32)})
    shard = next(out.glob("*.safetensors"))
    raw = bytearray(shard.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    # Spoil b's bytes only (same size, so the stat checks pass): a and count() stay right.
    begin, end = header["b"]["data_offsets"]
    raw[8 + n + begin : 8 + n + end] = np.full((8, 2), 9, np.float32).tobytes()
    shard.write_bytes(bytes(raw))
    assert load(spark, jvm, out).select("a").collect()[0].a == [1.0] * 4
    # a header that no longer parses: count() still answers from the manifest
    shard.write_bytes(b"\xff" * len(raw))
    assert load(spark, jvm, out).count() == 8
    plan = load(spark, jvm, out).groupBy().count()._jdf.queryExecution().executedPlan().toString()
    assert "count(*) = 8 from the manifest" in plan
    with pytest.raises(Exception, match="header length"):
        load(spark, jvm, out).select("a").collect()


def test_refusals_name_the_file_and_the_rule(spark, jvm, tmp_path):
    out = tmp_path / "ds"
    write_batch_dataset(out, {"a": np.ones((4, 2), np.float32)})
    with pytest.raises(Exception, match="view='kv' does not fit a batch-mode dataset"):
        load(spark, jvm, out, view="kv")
    with pytest.raises(Exception, match="unknown read option 'colour'"):
        load(spark, jvm, out, colour="red")
    with pytest.raises(Exception, match="rows_per_partition=0 must be at least 1"):
        load(spark, jvm, out, rows_per_partition=0)
    shard = next(out.glob("*.safetensors"))
    with open(shard, "ab") as f:
        f.write(b"\0")
    with pytest.raises(Exception, match=f"size differs from the manifest: {shard.name}"):
        load(spark, jvm, out)
    shard.unlink()
    with pytest.raises(Exception, match=f"{shard.name} is missing"):
        load(spark, jvm, out)
    (tmp_path / "x.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(Exception, match=r"x\.safetensors'.*header length"):
        load(spark, jvm, tmp_path / "x.safetensors")


def test_header_disagreeing_with_the_manifest_is_refused(spark, jvm, tmp_path):
    out = tmp_path / "ds"
    write_batch_dataset(out, {"a": np.ones((4, 2), np.float32)})
    doc = json.loads((out / "dataset_manifest.json").read_text())
    doc["schema"]["a"]["dtype"] = "F64"
    (out / "dataset_manifest.json").write_text(json.dumps(doc))
    with pytest.raises(Exception, match="tensor 'a' is F32\\[4, 2\\], the manifest says F64"):
        load(spark, jvm, out).collect()


def test_the_jvm_table_writes_what_it_reads(spark, jvm, tmp_path):
    df = spark.range(5).select(
        F.array(F.col("id").cast("float"), F.lit(1.0).cast("float")).alias("x")
    )
    writer(df, jvm).option("batch_size", 2).mode("overwrite").save(str(tmp_path))
    assert sorted(r.x[0] for r in load(spark, jvm, tmp_path).collect()) == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert Path(tmp_path, "dataset_manifest.json").is_file()


def test_remote_paths_are_read_by_ranged_reads_through_hadoop(spark, jvm, tmp_path):
    """A file system that is not ``file`` (the shim's local-backed ``stlocal`` test store):
    the JVM reader takes its object-store path (ranged reads, no memory map) and gives the
    rows the Python reader gives for the same files."""
    conf = spark.sparkContext._jsc.hadoopConfiguration()
    conf.set("fs.stlocal.impl", "io.github.pysparksafetensors.testing.LocalObjectStore")
    conf.set("fs.stlocal.impl.disable.cache", "true")
    out = tmp_path / "ds"
    x = np.arange(60, dtype=np.float32).reshape(20, 3)
    write_batch_dataset(out, {"x": x, "h": to_f16(x)}, rows_per_shard=7)
    remote = load(spark, jvm, f"stlocal://{out}", rows_per_partition=3)
    local = load(spark, PYTHON, out)
    assert sorted(map(repr, remote.collect())) == sorted(map(repr, local.collect()))
    assert remote.select("x").count() == 20
    kv = tmp_path / "kv"
    spark.range(6).select(
        F.col("id").cast("string").alias("k"), F.array(F.col("id").cast("float")).alias("v")
    ).write.format("safetensors").options(implementation=PYTHON, name_col="k").mode(
        "overwrite"
    ).save(str(kv))
    got = load(spark, jvm, f"stlocal://{kv}").where(F.col("k") == "4").collect()
    assert [(r.k, r.v) for r in got] == [("4", [4.0])]
    tensors = load(spark, jvm, f"stlocal://{kv}", view="tensors").collect()
    assert {r.file.split("://")[0] for r in tensors} == {"stlocal"}


def test_struct_dimensions_beyond_int32_are_refused_with_the_tensor_named(spark, jvm, tmp_path):
    from pyspark_safetensors.format import write_shard

    write_shard(tmp_path / "huge.safetensors", {"k1__x": np.empty((0, 2**33), np.float32)})
    with pytest.raises(Exception, match=r"'k1__x'.*above 2\^31 - 1.*view=tensors"):
        load(spark, jvm, tmp_path).collect()
    listed = load(spark, jvm, tmp_path, include_data="false").collect()
    assert [(r.name, r.shape) for r in listed] == [("k1__x", [0, 2**33])]
