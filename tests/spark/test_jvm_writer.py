"""The JVM writer (jvm-shim, ``write/``) against the Python writer: for the same DataFrame
and options both produce the same shards byte for byte (the uuid in names aside), the same
manifest (ids and times aside) and the same index; either appends to the other's dataset;
both take the same option table and refuse the same things."""

import dataclasses
import json
import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from pyspark.sql import functions as F

from implementations import reader, require, writer
from pyspark_safetensors.dataset import verify_dataset
from pyspark_safetensors.spark.options import WRITER_OPTIONS, WriterOptions
from pyspark_safetensors.torch import open_dataset

pytestmark = [pytest.mark.spark, pytest.mark.python_source]

PYTHON_SOURCE = "python"


@pytest.fixture(scope="module")
def jvm(spark):
    """The JVM writer's implementation name; skips when the session has no shim jar."""
    return require(spark, "jvm")


def write(df, fmt, path, mode="overwrite", **options):
    writer(df, fmt).options(**{k: str(v) for k, v in options.items()}).mode(mode).save(str(path))


def shard_bytes(path) -> dict[str, bytes]:
    """Shard contents by ``part-{task}-{shard}`` (the attempt's uuid left out)."""
    return {p.name[:15]: p.read_bytes() for p in sorted(Path(path).glob("part-*.safetensors"))}


def manifest_of(path) -> dict:
    """The manifest without what differs per commit: ids, times, uuids in names."""
    doc = json.loads((Path(path) / "dataset_manifest.json").read_text())
    for key in ("commit_id", "parent_commit", "created_at", "index_file", "index_crc32c"):
        doc.pop(key, None)
    doc["created_by"] = doc["created_by"].removesuffix(" (JVM)")  # which writer made it
    for shard in doc["shards"]:
        shard["shard_path"] = shard["shard_path"][:15]
    return doc


def index_of(path) -> list[dict]:
    rows = pq.read_table(Path(path) / "_tensor_index.parquet").to_pylist()
    return [{**r, "file_name": r["file_name"][:15]} for r in rows]


def index_from_headers(path) -> list[dict]:
    """The index the manifest's shards imply, in the manifest's order, from their headers."""
    rows = []
    for shard in json.loads((Path(path) / "dataset_manifest.json").read_text())["shards"]:
        with open(Path(path) / shard["shard_path"], "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        header.pop("__metadata__", None)
        for key, t in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"]):
            begin, end = (8 + size + o for o in t["data_offsets"])
            name = shard["shard_path"][:15]
            rows.append(dict(tensor_key=key, file_name=name, shape=t["shape"], dtype=t["dtype"],
                             begin=begin, end=end))  # fmt: skip
    return rows


def frame(spark, n=700, parts=2):
    return spark.range(n, numPartitions=parts).select(
        F.col("id").cast("string").alias("key"),
        F.array(*[(F.col("id") * 0.37 + i).cast("float") for i in range(8)]).alias("x"),
        (F.col("id") % 7).cast("int").alias("n"),
        F.array(
            F.array(F.col("id").cast("double"), F.lit(1.5)), F.array(F.lit(2.0), F.lit(-3.25))
        ).alias("m"),
    )


TWIN_CASES = {
    "batch": dict(batch_size=128),
    "batch-f16-pad-index": dict(batch_size=128, dtype="F16", tail_strategy="pad", generate_index="true"),
    "batch-json-dtype-drop-metadata": dict(
        batch_size=100, dtype='{"x": "bf16", "n": "u8"}', tail_strategy="drop",
        metadata='{"b": "2", "a": "é\\n"}', checksum="none",
    ),
    "kv": dict(name_col="key"),
    "kv-f16-separator-columns": dict(name_col="key", dtype="half", kv_separator="/", columns="x,m"),
    "kv-rollover": dict(name_col="key", target_shard_size_mb=50),
}  # fmt: skip


@pytest.mark.parametrize("case", TWIN_CASES)
def test_both_writers_write_the_same_dataset(spark, jvm, tmp_path, case):
    options = TWIN_CASES[case]
    df = frame(spark) if "name_col" in options else frame(spark).drop("key")
    write(df, PYTHON_SOURCE, tmp_path / "py", **options)
    write(df, jvm, tmp_path / "jvm", **options)
    py, jv = shard_bytes(tmp_path / "py"), shard_bytes(tmp_path / "jvm")
    assert py and py.keys() == jv.keys()
    for name in py:
        assert py[name] == jv[name], f"{name} differs"
    assert manifest_of(tmp_path / "py") == manifest_of(tmp_path / "jvm")
    if options.get("generate_index") == "true" or "name_col" in options:
        assert index_of(tmp_path / "py") == index_of(tmp_path / "jvm")
    verify_dataset(str(tmp_path / "jvm"), checksums=True)  # raises on any mismatch


@pytest.mark.arrow_udf
def test_tensor_structs_and_scalars_are_twins(spark, jvm, tmp_path):
    from pyspark_safetensors.spark.functions import arr_to_st

    df = spark.range(40, numPartitions=2).select(
        F.col("id").cast("string").alias("key"),
        arr_to_st(F.array(F.col("id").cast("float"), F.lit(0.5)), [2], "F16").alias("s"),
        F.col("id").cast("short").alias("scalar"),
    )
    for fmt, out in ((PYTHON_SOURCE, "py"), (jvm, "jvm")):
        write(df.drop("key"), fmt, tmp_path / out, batch_size=16, dtype='{"s": "F32"}')
        write(df, fmt, tmp_path / f"{out}-kv", name_col="key")
    assert shard_bytes(tmp_path / "py") == shard_bytes(tmp_path / "jvm")
    assert shard_bytes(tmp_path / "py-kv") == shard_bytes(tmp_path / "jvm-kv")


@pytest.mark.parametrize("first,second", [("python", "jvm"), ("jvm", "python")])
def test_either_writer_appends_to_the_others_dataset(spark, jvm, tmp_path, first, second):
    fmt = {"python": PYTHON_SOURCE, "jvm": jvm}
    df = frame(spark, n=300)
    write(df, fmt[first], tmp_path / "kv", name_col="key")
    later = df.withColumn("key", F.concat(F.col("key"), F.lit("-b")))
    write(later, fmt[second], tmp_path / "kv", mode="append", name_col="key")
    doc = json.loads((tmp_path / "kv" / "dataset_manifest.json").read_text())
    assert doc["total_samples"] == 600 and len(doc["shards"]) == 4
    assert [s["first_sample"] for s in doc["shards"]] == [0, 150, 300, 450]
    assert index_of(tmp_path / "kv") == index_from_headers(tmp_path / "kv")  # both commits'
    back = reader(spark, PYTHON_SOURCE).load(str(tmp_path / "kv"))
    assert back.count() == 600
    with pytest.raises(Exception, match="duplicate tensor keys across shards"):
        write(df.limit(5), fmt[second], tmp_path / "kv", mode="append", name_col="key")
    with pytest.raises(Exception, match="cannot append batch-mode data to a kv-mode dataset"):
        write(df.drop("key"), fmt[second], tmp_path / "kv", mode="append", batch_size=10)


def test_overwrite_deletes_the_replaced_generation_unless_kept(spark, jvm, tmp_path):
    df = frame(spark, n=200).drop("key")
    out = tmp_path / "ds"
    write(df, jvm, out, batch_size=64, generate_index="true")
    first = set(shard_bytes(out))
    old = {p.name for p in out.glob("part-*")}
    write(df, jvm, out, batch_size=64, generate_index="true")
    names = {p.name for p in out.iterdir()}
    doc = json.loads((out / "dataset_manifest.json").read_text())
    listed = {s["shard_path"] for s in doc["shards"]}
    assert names == listed | {
        "dataset_manifest.json",
        "_SUCCESS",
        "_tensor_index.parquet",
        doc["index_file"],
    }
    assert not names & old and set(shard_bytes(out)) == first
    write(df, jvm, out, batch_size=64, keep_previous_generation="true")
    assert listed <= {p.name for p in out.iterdir()}  # kept for readers of the old manifest
    assert not (out / "_tensor_index.parquet").exists()  # this commit has no index


def test_failed_first_write_leaves_no_directory(spark, jvm, tmp_path):
    df = spark.range(10, numPartitions=2).select(
        F.array((F.col("id") * 100).cast("int")).alias("v")
    )
    with pytest.raises(
        Exception, match=r"column 'v' \(row \d+ of this partition\): value \d+ overflows I8"
    ):
        write(df, jvm, tmp_path / "new", batch_size=4, dtype="I8")
    assert not (tmp_path / "new").exists()


def test_option_table_is_the_python_writers(spark, jvm):
    """Both writers take the same option names, with the same defaults."""
    table = json.loads(spark._jvm.io.github.pysparksafetensors.write.WriterOptions.describe())
    assert table["names"] == list(WRITER_OPTIONS[1:])
    fields = {f.name: f for f in dataclasses.fields(WriterOptions)}
    renamed = {"duplicatesStrategy": "duplicates_strategy"}
    for name, text in table["defaults"].items():
        field = fields[renamed.get(name, name)]
        default = (
            field.default
            if field.default_factory is dataclasses.MISSING
            else field.default_factory()
        )
        parsed = json.loads(text) if name == "metadata" else text
        assert (
            str(default).lower() == str(parsed).lower()
            if isinstance(default, bool)
            else default == type(default)(parsed)
        ), name
    # batch_size, name_col, dtype, columns, shapes have no default; generate_index's depends
    # on the mode; implementation picks the source before either parses the options
    assert set(WRITER_OPTIONS[1:]) - set(table["defaults"]) == {
        "batch_size", "name_col", "dtype", "columns", "shapes", "generate_index", "implementation",
    }  # fmt: skip


REFUSED = {
    "unknown option": (dict(batch_size=4, dtpye="F16"), r"unknown option\(s\) dtpye \(did you mean dtype\?\)"),
    "both modes": (dict(batch_size=4, name_col="key"), "set exactly one of batch_size"),
    "bad dtype": (dict(batch_size=4, dtype="F8_E4M3"), "F8_E4M3 can be read but not written"),
    "shard size": (dict(name_col="key", target_shard_size_mb=10), "target_shard_size_mb=10: must be between 50 and 1000"),
    "empty separator": (dict(name_col="key", kv_separator=""), "option kv_separator is empty"),
    "bad shapes": (dict(batch_size=4, shapes='{"x": [-1]}'), "option shapes: a JSON object"),
    "unknown column": (dict(batch_size=4, columns="nope"), r"option names column\(s\) \['nope'\]"),
    "key type": (dict(name_col="n"), "name_col 'n' has type int; the key column must be a string"),
}  # fmt: skip


@pytest.mark.parametrize("case", REFUSED)
def test_both_writers_refuse_the_same_options(spark, jvm, tmp_path, case):
    options, message = REFUSED[case]
    df = frame(spark, n=8)
    for fmt in (PYTHON_SOURCE, jvm):
        with pytest.raises(Exception, match=message):
            write(df, fmt, tmp_path / re.sub(r"\W", "", fmt), **options)


def test_object_store_paths_are_written_without_renames(spark, jvm, tmp_path):
    """A file system that is not ``file`` and refuses ``rename`` (the shim's ``stlocal``
    test store, with an object store's semantics): the JVM writer puts each file once under
    its final name, the bytes are those of a local write, and the Python readers read it."""
    conf = spark.sparkContext._jsc.hadoopConfiguration()
    conf.set("fs.stlocal.impl", "io.github.pysparksafetensors.testing.LocalObjectStore")
    conf.set("fs.stlocal.impl.disable.cache", "true")
    for name, options in (
        ("batch", dict(batch_size=128, generate_index="true")),
        ("kv", dict(name_col="key")),
    ):
        df = frame(spark) if "name_col" in options else frame(spark).drop("key")
        remote, local = tmp_path / name, tmp_path / f"{name}-local"
        for _ in range(2):  # the second overwrite deletes the first generation
            write(df, jvm, f"stlocal://{remote}", **options)
        write(df, jvm, local, **options)
        assert shard_bytes(remote) == shard_bytes(local)
        assert manifest_of(remote) == manifest_of(local)
        manifest = verify_dataset(str(remote), checksums=True)
        named = {s.shard_path for s in manifest.shards} | {"dataset_manifest.json", "_SUCCESS"}
        named |= {"_tensor_index.parquet", manifest.index_file} - {None}
        assert {p.name for p in remote.iterdir()} == named
        assert len(open_dataset(str(remote))) == 700
        assert reader(spark, PYTHON_SOURCE).load(str(remote)).count() == 700
