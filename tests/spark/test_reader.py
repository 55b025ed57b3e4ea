"""The Spark reader: round trips, plain files, header-only listings, bad inputs."""

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from pyspark.sql import functions as F
from safetensors.torch import save_file

from implementations import IMPLEMENTATIONS, reader, require
from pyspark_safetensors.format import WRITABLE, get_dtype

pytestmark = pytest.mark.spark


def write(df, path, mode="overwrite", **options):
    w = df.write.format("safetensors").mode(mode)
    for k, v in options.items():
        w = w.option(k, v)
    w.save(str(path))


_implementation = "python"
"""The reader of the running test: each test reads with both (tests/implementations.py)."""


@pytest.fixture(autouse=True, params=IMPLEMENTATIONS)
def impl(request, spark):
    """The reader under test; the JVM one skips when the session's jar lacks it."""
    global _implementation
    _implementation = require(spark, request.param)
    yield request.param
    _implementation = "python"


def read(spark, path, **options):
    r = reader(spark, _implementation)
    for k, v in options.items():
        r = r.option(k, v)
    return r.load(str(path))


@pytest.mark.parametrize("dtype", WRITABLE)
def test_round_trip_every_dtype_both_modes(spark, tmp_path, dtype):
    d = get_dtype(dtype)
    vals = [0.0, -1.5, 3.25, 100.0] if d.is_float else [0, 1, 7, 100]
    typ = "double" if d.is_float else "long"
    df = spark.createDataFrame(
        [(str(i), [v, v], v) for i, v in enumerate(vals)], f"k string, x array<{typ}>, s {typ}"
    )
    spec = json.dumps({"x": dtype, "s": dtype})
    write(df.select("x", "s"), tmp_path / "b", batch_size=3, dtype=spec)
    rows = sorted((r.s, r.x) for r in read(spark, tmp_path / "b").collect())
    assert rows == sorted((v, [v, v]) for v in vals)
    write(df, tmp_path / "k", name_col="k", dtype=spec)
    kv = {r.k: (r.x, r.s) for r in read(spark, tmp_path / "k").collect()}
    assert kv == {str(i): ([v, v], v) for i, v in enumerate(vals)}


def test_nested_rows_and_partition_splitting(spark, tmp_path):
    df = spark.range(100, numPartitions=1).select(
        F.array(
            F.array(F.col("id").cast("float"), F.lit(1.0)), F.array(F.lit(2.0), F.lit(3.0))
        ).alias("m")
    )
    write(df, tmp_path / "n", batch_size=100)
    r = read(spark, tmp_path / "n", rows_per_partition=30)
    assert r.rdd.getNumPartitions() == 4
    rows = sorted(x.m for x in r.collect())
    assert len(rows) == 100 and rows[5] == [[5.0, 1.0], [2.0, 3.0]]


def test_kv_variable_shapes_and_struct_format(spark, tmp_path):
    df = spark.createDataFrame(
        [("a", [[1.0, 2.0]]), ("b", [[1.0, 2.0], [3.0, 4.0]])], "k string, seq array<array<float>>"
    )
    write(df, tmp_path / "kv", name_col="k")
    got = {r.k: r.seq for r in read(spark, tmp_path / "kv").collect()}
    assert got == {"a": [[1.0, 2.0]], "b": [[1.0, 2.0], [3.0, 4.0]]}
    s = {r.k: r.seq for r in read(spark, tmp_path / "kv", tensor_format="struct").collect()}
    assert s["b"].shape == [2, 2] and s["b"].dtype == "F32"
    assert np.frombuffer(s["b"].data, np.float32).tolist() == [1, 2, 3, 4]


def test_reference_checkpoint_tensors_view(spark, tmp_path):
    weights = {
        "encoder.weight": torch.randn(4, 3),
        "encoder.bias": torch.zeros(4, dtype=torch.bfloat16),
        "step": torch.tensor(7),
    }
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    df = read(spark, tmp_path / "model.safetensors")
    rows = {r.name: r for r in df.collect()}
    assert set(rows) == set(weights)
    w = rows["encoder.weight"]
    assert w.dtype == "F32" and w.shape == [4, 3]
    np.testing.assert_array_equal(
        np.frombuffer(w.data.data, np.float32).reshape(4, 3), weights["encoder.weight"].numpy()
    )
    assert rows["step"].shape == [] and rows["encoder.bias"].dtype == "BF16"
    # a directory of checkpoints, and a glob
    save_file({"x": torch.ones(2)}, tmp_path / "other.safetensors")
    assert read(spark, tmp_path).count() == 4
    assert read(spark, str(tmp_path / "oth*.safetensors")).count() == 1
    # pushed-down or not, filters give the same answer
    for enabled in ("true", "false"):
        spark.conf.set("spark.sql.python.filterPushdown.enabled", enabled)
        try:
            names = sorted(
                r.name
                for r in read(spark, tmp_path).where(F.col("name").isin("step", "x")).collect()
            )
            assert names == ["step", "x"]
            assert read(spark, tmp_path).where(F.col("dtype") == "BF16").count() == 1
        finally:
            spark.conf.unset("spark.sql.python.filterPushdown.enabled")


def test_header_only_listing_reads_no_tensor_bytes(spark, tmp_path):
    # A 1 TiB tensor in a sparse file: listing it must not touch the data region.
    header = json.dumps(
        {"huge": {"dtype": "U8", "shape": [2**40], "data_offsets": [0, 2**40]}}
    ).encode()
    header += b" " * (-len(header) % 8)
    path = tmp_path / "huge.safetensors"
    with open(path, "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
        f.truncate(8 + len(header) + 2**40)
    rows = read(spark, path, include_data="false").collect()
    assert [(r.name, r.shape) for r in rows] == [("huge", [2**40])]
    assert "data" not in read(spark, path, include_data="false").columns
    assert os.stat(path).st_blocks * 512 < 1 << 20  # still sparse: nothing was read or written


def test_explicit_schema_is_honoured_and_checked(spark, tmp_path):
    write(
        spark.range(4, numPartitions=1).select(F.array(F.col("id").cast("float")).alias("v"), "id"),
        tmp_path / "s",
        batch_size=4,
    )
    r = reader(spark, _implementation).schema("v array<float>").load(str(tmp_path / "s"))
    assert r.columns == ["v"] and r.count() == 4
    with pytest.raises(Exception, match=r"column 'v'.*array<double>"):
        reader(spark, _implementation).schema("v array<double>").load(str(tmp_path / "s")).collect()
    with pytest.raises(Exception, match=r"column\(s\) \['nope'\]"):
        reader(spark, _implementation).schema("nope int").load(str(tmp_path / "s")).collect()


@pytest.fixture
def small_dataset(spark, tmp_path):
    out = tmp_path / "ds"
    write(
        spark.range(6, numPartitions=2).select(F.array(F.col("id").cast("float")).alias("v")),
        out,
        batch_size=3,
    )
    return out


def shard_files(path):
    return sorted(Path(path).glob("*.safetensors"))


def test_truncated_shard_names_the_file(spark, small_dataset):
    manifest = json.loads((small_dataset / "dataset_manifest.json").read_text())
    victim = shard_files(small_dataset)[0]
    data = victim.read_bytes()
    victim.write_bytes(data[:-4])
    with pytest.raises(
        Exception, match=re.escape(f"size differs from the manifest: {victim.name}")
    ):
        read(spark, small_dataset).collect()
    manifest["shards"][0]["bytes"] = len(data) - 4
    manifest["total_bytes"] -= 4
    (small_dataset / "dataset_manifest.json").write_text(json.dumps(manifest))
    bad = next(s["shard_path"] for s in manifest["shards"] if s["bytes"] == len(data) - 4)
    with pytest.raises(Exception, match=f"{bad}.*rule"):
        read(spark, small_dataset).collect()


def test_missing_shard_and_escaping_path(spark, small_dataset):
    manifest_path = small_dataset / "dataset_manifest.json"
    manifest = json.loads(manifest_path.read_text())
    shard_files(small_dataset)[0].unlink()
    with pytest.raises(Exception, match="missing"):
        read(spark, small_dataset).collect()
    manifest["shards"][0]["shard_path"] = "../outside.safetensors"
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(Exception, match="must be a relative name inside the dataset"):
        read(spark, small_dataset).collect()


def test_shard_disagreeing_with_manifest(spark, small_dataset):
    victim = shard_files(small_dataset)[0]
    from pyspark_safetensors.format import write_shard

    write_shard(victim, {"v": np.zeros((3, 2), np.float32)})
    manifest = json.loads((small_dataset / "dataset_manifest.json").read_text())
    for s in manifest["shards"]:
        if s["shard_path"] == victim.name:
            manifest["total_bytes"] += victim.stat().st_size - s["bytes"]
            s["bytes"] = victim.stat().st_size
    (small_dataset / "dataset_manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(
        Exception, match=f"{victim.name}.*tensor 'v' is F32\\[3, 2\\], the manifest says F32"
    ):
        read(spark, small_dataset).collect()
