"""The Spark writer on a real local Spark: modes, dtypes, manifest, index, commit."""

import json
import re
import struct
from pathlib import Path

import jsonschema
import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from pyspark.sql import functions as F
from safetensors import safe_open
from safetensors.numpy import load_file
from safetensors.torch import save

from implementations import IMPLEMENTATIONS, require, writer
from pyspark_safetensors.format import WRITABLE, get_dtype, write_shard

pytestmark = pytest.mark.spark


def shards(path) -> list[Path]:
    return sorted(Path(path).glob("*.safetensors"))


def manifest(path) -> dict:
    return json.loads((Path(path) / "dataset_manifest.json").read_text())


def load_all(path) -> dict:
    out = {}
    for f in shards(path):
        with safe_open(str(f), "pt") as g:
            out[f.name] = {k: g.get_tensor(k) for k in g.keys()}  # noqa: SIM118 - safe_open is not iterable
    return out


def vectors_df(spark, n=10, dim=3, parts=2):
    return spark.range(n, numPartitions=parts).select(
        F.col("id"),
        F.array(*[(F.col("id") * 10 + j).cast("float") for j in range(dim)]).alias("vec"),
        F.col("id").cast("string").alias("key"),
    )


_implementation = "python"
"""The writer of the running test: each test writes with both (tests/implementations.py)."""


@pytest.fixture(params=IMPLEMENTATIONS, autouse=True)
def impl(request, spark):
    """Every test writes with the Python writer, then with the JVM one when the session's
    shim jar has it; ``write`` uses the one of the running test."""
    global _implementation
    _implementation = require(spark, request.param)
    yield request.param
    _implementation = "python"


def write(df, path, mode="overwrite", **options):
    w = writer(df, _implementation).mode(mode)
    for k, v in options.items():
        w = w.option(k, v)
    w.save(str(path))


# ------------------------------------------------------------------ batch mode


def test_batch_mode_layout_manifest_and_values(spark, tmp_path, repo_root):
    out = tmp_path / "ds"
    write(
        vectors_df(spark).select("vec", "id"),
        out,
        batch_size=3,
        generate_index="true",
        metadata='{"model": "m"}',
    )
    m = manifest(out)
    schema = json.loads((repo_root / "manifest-jsonschema.json").read_text())
    jsonschema.validate(m, schema)
    assert m["total_samples"] == 10 and m["mode"] == "batch" and m["metadata"] == {"model": "m"}
    assert m["schema"]["vec"] == {"dtype": "F32", "shape": [3, 3], "sample_shape": [3]}
    assert m["schema"]["id"]["dtype"] == "I64"
    names = [s["shard_path"] for s in m["shards"]]
    assert names == sorted(f.name for f in shards(out))  # no stray files, all listed
    assert all(
        Path(out / n).stat().st_size == s["bytes"] for n, s in zip(names, m["shards"], strict=False)
    )
    assert [s["first_sample"] for s in m["shards"]] == list(
        np.cumsum([0] + [s["samples_count"] for s in m["shards"]])[:-1]
    )
    assert sum(m["shards"][i]["samples_count"] for i in range(len(names))) == 10
    import re

    assert all(re.match(r"^part-\d{5}-\d{4}-[0-9a-f-]{36}\.safetensors$", n) for n in names)
    ids, vecs = [], []
    for f in shards(out):
        t = load_file(f)
        with safe_open(str(f), "np") as g:
            assert g.metadata()["model"] == "m"
        ids += t["id"].tolist()
        vecs.append(t["vec"])
    assert sorted(ids) == list(range(10))
    v = np.concatenate(vecs)
    np.testing.assert_array_equal(
        v, np.array([[i * 10 + j for j in range(3)] for i in ids], dtype=np.float32)
    )
    assert (out / "_SUCCESS").exists() and not (out / "_temporary").exists()


def test_bytes_equal_reference_library(spark, tmp_path):
    out = tmp_path / "ds"
    write(
        vectors_df(spark, n=4, parts=1).select("vec", "id"),
        out,
        batch_size=4,
        dtype="BF16",
        checksum="none",
    )
    (f,) = shards(out)
    with safe_open(str(f), "pt") as g:
        tensors = {k: g.get_tensor(k) for k in g.keys()}  # noqa: SIM118 - safe_open is not iterable
        md = g.metadata()
    expected_vec = torch.tensor(
        [[i * 10 + j for j in range(3)] for i in range(4)], dtype=torch.float32
    ).to(torch.bfloat16)
    assert torch.equal(tensors["vec"], expected_vec)
    blob = f.read_bytes()
    n = struct.unpack("<Q", blob[:8])[0]
    ref = save(tensors, metadata=None)
    ref_n = struct.unpack("<Q", ref[:8])[0]
    # identical tensor entries, alignment and data region; only our __metadata__ differs
    ours_header = json.loads(blob[8 : 8 + n])
    ours_header.pop("__metadata__")
    assert ours_header == json.loads(ref[8 : 8 + ref_n])
    assert blob[8 + n :] == ref[8 + ref_n :]
    assert md["writer"].startswith("pyspark-safetensors")


@pytest.mark.parametrize("dtype", WRITABLE)
def test_every_dtype_round_trips_both_modes(spark, tmp_path, dtype):
    d = get_dtype(dtype)
    values = [0, 1, 2, 100] if d.is_integer else [0.0, -1.5, 3.25, 1e3]
    spark_type = "double" if d.is_float else "long"
    df = spark.createDataFrame(
        [(str(i), [float(v) if d.is_float else int(v)] * 2) for i, v in enumerate(values)],
        f"key string, x array<{spark_type}>",
    )
    write(df.select("x"), tmp_path / "b", batch_size=4, dtype=f'{{"x": "{dtype}"}}')
    write(df, tmp_path / "k", name_col="key", dtype=f'{{"x": "{dtype}"}}')
    batch = np.concatenate([load_file(f)["x"] for f in shards(tmp_path / "b")])
    assert sorted(batch[:, 0].astype(np.float64).tolist()) == sorted(float(v) for v in values)
    with safe_open(str(shards(tmp_path / "b")[0]), "pt") as g:
        assert g.get_slice("x").get_dtype() == dtype
    kv = {}
    for f in shards(tmp_path / "k"):
        with safe_open(str(f), "pt") as g:
            kv.update({k: g.get_tensor(k) for k in g.keys()})  # noqa: SIM118 - safe_open is not iterable
    assert set(kv) == {f"{i}__x" for i in range(4)}
    for i, v in enumerate(values):
        assert kv[f"{i}__x"].double().tolist() == [float(v)] * 2


def test_f16_rounding_is_nearest_even_like_torch(spark, tmp_path):
    vals = [
        1 + 2**-11,
        1 + 3 * 2**-11,
        65504.0,
        65520.0,
        1e-8,
        float("nan"),
        float("inf"),
        -float("inf"),
    ]
    df = spark.createDataFrame([(vals,)], "x array<double>")
    write(df, tmp_path / "h", batch_size=1, dtype="F16")
    got = load_file(shards(tmp_path / "h")[0])["x"][0].view(np.uint16)
    expected = (
        torch.tensor(vals, dtype=torch.float64)
        .to(torch.float16)
        .view(torch.int16)
        .numpy()
        .view(np.uint16)
    )
    np.testing.assert_array_equal(got, expected)


def test_tail_strategies(spark, tmp_path):
    df = vectors_df(spark, n=10, parts=1).select("vec")
    for strategy, expected_rows in [("write", [4, 4, 2]), ("drop", [4, 4]), ("pad", [4, 4, 4])]:
        out = tmp_path / strategy
        write(df, out, batch_size=4, tail_strategy=strategy)
        rows = [load_file(f)["vec"].shape[0] for f in shards(out)]
        assert sorted(rows, reverse=True) == expected_rows
        assert manifest(out)["total_samples"] == sum(expected_rows)
    padded = [load_file(f)["vec"] for f in shards(tmp_path / "pad")]
    (tail,) = [t for t in padded if t[0, 0] == 80.0]  # rows 8 and 9, then two rows of zeros
    assert tail[:2, 0].tolist() == [80.0, 90.0] and (tail[2:] == 0).all()


def test_shapes_option_and_nested_arrays(spark, tmp_path):
    df = spark.range(4, numPartitions=1).select(
        F.array(*[F.lit(float(j)) for j in range(6)]).alias("flat")
    )
    write(df, tmp_path / "s", batch_size=4, shapes='{"flat": [2, 3]}')
    assert load_file(shards(tmp_path / "s")[0])["flat"].shape == (4, 2, 3)
    nested = spark.createDataFrame([([[1, 2, 3], [4, 5, 6]],)] * 3, "m array<array<int>>").coalesce(
        1
    )
    write(nested, tmp_path / "n", batch_size=3)
    t = load_file(shards(tmp_path / "n")[0])["m"]
    assert t.shape == (3, 2, 3) and t.dtype == np.int32 and t[2].tolist() == [[1, 2, 3], [4, 5, 6]]
    with pytest.raises(Exception, match=r"do not fit shapes=\[4, 2\]"):
        write(df, tmp_path / "bad", batch_size=4, shapes='{"flat": [4, 2]}')
    assert not shards(tmp_path / "bad")


def test_scalars_and_tensor_structs(spark, tmp_path):
    blob = np.arange(6, dtype=np.float32).tobytes()
    df = spark.createDataFrame(
        [(i, 0.5 * i, (blob, [2, 3], "F32")) for i in range(3)],
        "i int, f double, t struct<data: binary, shape: array<int>, dtype: string>",
    ).coalesce(1)
    write(df, tmp_path / "st", batch_size=3, dtype="F16")
    t = load_file(shards(tmp_path / "st")[0])
    # a plain dtype covers every numeric column, integers too (exact, checked casts)
    assert t["i"].dtype == np.float16 and t["i"].tolist() == [0, 1, 2]
    assert t["f"].dtype == np.float16 and t["f"].tolist() == [0, 0.5, 1.0]
    assert t["t"].dtype == np.float16 and t["t"].shape == (3, 2, 3)
    np.testing.assert_array_equal(t["t"][1], np.arange(6).reshape(2, 3))


def test_nan_and_inf_are_data(spark, tmp_path):
    df = spark.createDataFrame([([float("nan"), float("inf"), -float("inf")],)], "x array<float>")
    write(df, tmp_path / "x", batch_size=1)
    x = load_file(shards(tmp_path / "x")[0])["x"][0]
    assert np.isnan(x[0]) and x[1] == np.inf and x[2] == -np.inf


# ------------------------------------------------------------------ KV mode


def test_kv_mode_names_separator_index(spark, tmp_path):
    out = tmp_path / "kv"
    write(vectors_df(spark, n=6), out, name_col="key", columns="vec,id", kv_separator="::")
    m = manifest(out)
    assert (
        m["mode"] == "kv"
        and m["name_col"] == "key"
        and m["kv_separator"] == "::"
        and m["total_samples"] == 6
    )
    assert re.fullmatch(r"_tensor_index-[0-9a-f]{32}\.parquet", m["index_file"])
    idx = pq.read_table(out / m["index_file"]).to_pylist()
    assert {r["tensor_key"] for r in idx} == {f"{i}::{c}" for i in range(6) for c in ("vec", "id")}
    for r in idx:  # absolute offsets fetch exactly the tensor
        raw = (out / r["file_name"]).read_bytes()[r["begin"] : r["end"]]
        if r["tensor_key"].endswith("::vec"):
            i = int(r["tensor_key"].split("::")[0])
            assert np.frombuffer(raw, np.float32).tolist() == [i * 10, i * 10 + 1, i * 10 + 2]
            assert r["shape"] == [3] and r["dtype"] == "F32"


def test_kv_rollover_at_target_size(spark, tmp_path):
    dim = 256 * 1024  # 1 MiB of float32 per row
    df = spark.range(120, numPartitions=1).select(
        F.col("id").cast("string").alias("k"),
        F.array_repeat(F.col("id").cast("float"), dim).alias("v"),
    )
    write(df, tmp_path / "r", name_col="k", target_shard_size_mb=50)
    files = shards(tmp_path / "r")
    assert len(files) == 3
    assert all(f.stat().st_size <= 50_000_000 + 1_100_000 for f in files)
    assert manifest(tmp_path / "r")["total_samples"] == 120


def test_kv_variable_shapes_per_row(spark, tmp_path):
    df = spark.createDataFrame(
        [("a", [[1.0, 2.0]]), ("b", [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])],
        "k string, seq array<array<float>>",
    ).coalesce(1)
    write(df, tmp_path / "v", name_col="k")
    t = load_file(shards(tmp_path / "v")[0])
    assert t["a__seq"].shape == (1, 2) and t["b__seq"].shape == (3, 2)
    assert manifest(tmp_path / "v")["schema"]["seq"]["sample_shape"] == [-1, 2]


def test_kv_duplicates(spark, tmp_path):
    df = spark.createDataFrame(
        [("a", [1.0]), ("b", [2.0]), ("a", [3.0])], "k string, v array<double>"
    ).coalesce(1)
    with pytest.raises(Exception, match="duplicate key 'a'"):
        write(df, tmp_path / "d", name_col="k")
    assert not shards(tmp_path / "d")
    write(df, tmp_path / "d", name_col="k", duplicatesStrategy="lastWin")
    t = load_file(shards(tmp_path / "d")[0])
    assert t["a__v"].tolist() == [3.0] and manifest(tmp_path / "d")["total_samples"] == 2
    # across tasks the commit finds them, with or without a tensor index
    across = spark.range(0, 2, 1, numPartitions=2).selectExpr("'a' AS k", "array(id * 1.0D) AS v")
    for index in ("true", "false"):
        with pytest.raises(Exception, match="duplicate tensor keys across shards: 'a__v'"):
            write(across, tmp_path / f"x{index}", name_col="k", generate_index=index)
        assert not shards(tmp_path / f"x{index}")


def test_kv_rows_of_every_shape_over_many_batches(spark, tmp_path):
    """Ragged and nested arrays, scalars and Tensor Structs of mixed dtypes (cast to one),
    keys out of order and repeated across Arrow batches (lastWin): each tensor reads back
    as written, and every shard is laid out as the one-tensor-at-a-time writer does it."""
    rng = np.random.default_rng(3)
    rows, expected = [], {}
    for i in [*rng.permutation(60).tolist(), 5, 17, 42]:  # three keys come back later
        key = f"doc{i}"
        seq = rng.random((int(rng.integers(1, 4)), 3)).round(3).tolist()
        dtype, shape = ("F32", [2, 1]) if i % 3 else ("I16", [int(rng.integers(1, 4)), 1])
        blob = (np.arange(np.prod(shape)) + i).astype(get_dtype(dtype).numpy)
        rows.append((key, seq, i, (blob.tobytes(), shape, dtype)))
        expected[key] = (seq, i, blob.reshape(shape).astype(np.float64))
    df = spark.createDataFrame(
        rows,
        "k string, seq array<array<double>>, n int, "
        "t struct<data: binary, shape: array<int>, dtype: string>",
    ).coalesce(1)
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "7")
    try:
        write(df, tmp_path / "kv", name_col="k", duplicatesStrategy="lastWin", dtype='{"t": "F64"}')
    finally:
        spark.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")
    got = {}
    for f in shards(tmp_path / "kv"):
        tensors = load_file(f)
        with safe_open(str(f), "np") as g:
            metadata = g.metadata()
        write_shard(tmp_path / "again.safetensors", tensors, metadata)
        assert f.read_bytes() == (tmp_path / "again.safetensors").read_bytes()
        got.update(tensors)
    assert set(got) == {f"{k}__{c}" for k in expected for c in ("seq", "n", "t")}
    for key, (seq, n, blob) in expected.items():
        assert got[f"{key}__seq"].shape == (len(seq), 3) and got[f"{key}__seq"].dtype == np.float64
        np.testing.assert_allclose(got[f"{key}__seq"].reshape(-1), np.ravel(seq), rtol=1e-6)
        assert got[f"{key}__n"].shape == () and got[f"{key}__n"] == n
        assert got[f"{key}__t"].dtype == blob.dtype
        np.testing.assert_array_equal(got[f"{key}__t"], blob)
    m = manifest(tmp_path / "kv")
    assert m["total_samples"] == 60
    assert m["schema"]["seq"]["sample_shape"] == [-1, 3]
    assert m["schema"]["t"]["dtype"] == "F64" and m["schema"]["t"]["sample_shape"] == [-1, 1]


def test_kv_tensor_names_must_not_collide(spark, tmp_path):
    # 'c' and 'b__c' cannot be told apart after '<key>__': refused before any task runs
    df = spark.createDataFrame([("a__b", 1, 2), ("a", 3, 4)], "k string, c int, `b__c` int")
    with pytest.raises(Exception, match="KV columns 'c' and 'b__c' cannot be told apart"):
        write(df.coalesce(1), tmp_path / "c", name_col="k")
    assert_nothing_written(tmp_path / "c")


# ------------------------------------------------------------------ commit protocol


def test_append_then_overwrite(spark, tmp_path):
    out = tmp_path / "ao"
    df = vectors_df(spark, n=6).select("vec")
    write(df, out, batch_size=3, generate_index="true")
    first = {f.name for f in shards(out)}
    write(df, out, mode="append", batch_size=3, generate_index="true")
    m = manifest(out)
    assert m["total_samples"] == 12 and len(m["shards"]) == len(shards(out)) == 2 * len(first)
    assert pq.read_table(out / m["index_file"]).num_rows == len(m["shards"])
    with pytest.raises(Exception, match="column 'vec' is F32"):
        write(vectors_df(spark, n=3, dim=5).select("vec"), out, mode="append", batch_size=3)
    assert manifest(out)["total_samples"] == 12 and len(shards(out)) == 2 * len(first)
    appended = manifest(out)
    write(vectors_df(spark, n=2, parts=1).select("vec"), out, batch_size=3)
    m = manifest(out)
    assert m["total_samples"] == 2 and "index_file" not in m
    # the replaced generation and its indexes are deleted at the commit point
    assert [f.name for f in shards(out)] == sorted(s["shard_path"] for s in m["shards"])
    assert not (out / appended["index_file"]).exists()
    assert not list(out.glob("_tensor_index*"))


def test_append_refuses_missing_or_extra_columns(spark, tmp_path):
    out = tmp_path / "cols"
    write(vectors_df(spark, n=4).select("vec", "id"), out, batch_size=2)
    for columns in (["vec"], ["vec", "id", "key2"]):
        df = vectors_df(spark, n=4).withColumn("key2", F.col("id")).select(*columns)
        with pytest.raises(Exception, match="appended columns"):
            write(df, out, mode="append", batch_size=2)
    assert manifest(out)["total_samples"] == 4 and len(shards(out)) == len(manifest(out)["shards"])


# ------------------------------------------------------------------ bad input: clear errors, nothing left


def assert_nothing_written(path):
    assert not shards(path) and not (Path(path) / "dataset_manifest.json").exists()
    assert not list(Path(path).rglob("*.safetensors")) if Path(path).exists() else True


@pytest.mark.parametrize(
    "rows,ddl,options,message",
    [
        ([([1.0, 2.0],), ([1.0],)], "x array<double>", {"batch_size": 2}, "column 'x'.*ragged"),
        (
            [([[1.0, 2.0], [3.0, 4.0]],), ([[1.0, 2.0], [3.0]],)],
            "x array<array<double>>",
            {"batch_size": 2},
            r"column 'x' \(row 1 of this partition\).*ragged",
        ),
        ([([1.0, 2.0],), (None,)], "x array<double>", {"batch_size": 2}, "column 'x'.*null array"),
        ([([1.0, None],)], "x array<double>", {"batch_size": 2}, "column 'x'.*null element"),
        ([(None, [1.0])], "k string, x array<double>", {"name_col": "k"}, "null key"),
        (
            [("a", [1.0]), ("b", [2.0, None])],
            "k string, x array<double>",
            {"name_col": "k"},
            r"column 'x' \(key 'b'\): null element",
        ),
        (
            [("a", [[1.0], [2.0]]), ("b", [[1.0, 2.0], [3.0]])],
            "k string, x array<array<double>>",
            {"name_col": "k"},
            r"column 'x' \(key 'b'\): ragged arrays inside one row",
        ),
        (
            [("a", [1]), ("b", [300])],
            "k string, x array<int>",
            {"name_col": "k", "dtype": '{"x": "I8"}'},
            r"column 'x' \(key 'b'\): value 300 overflows I8",
        ),
        (
            [("a", (b"\0" * 8, [2], "F32")), ("b", (b"\0" * 6, [2], "F32"))],
            "k string, t struct<data: binary, shape: array<int>, dtype: string>",
            {"name_col": "k"},
            r"column 't' \(key 'b'\): Tensor Struct data has 6 bytes, shape \[2\] of F32 needs 8",
        ),
        (
            [([300],)],
            "x array<int>",
            {"batch_size": 1, "dtype": '{"x": "I8"}'},
            r"column 'x' \(row 0 of this partition\): value 300 overflows I8",
        ),
        (
            [([1.5],)],
            "x array<double>",
            {"batch_size": 1, "dtype": '{"x": "I32"}'},
            "not an integer",
        ),
    ],
)
def test_bad_data_fails_cleanly(spark, tmp_path, rows, ddl, options, message):
    df = spark.createDataFrame(rows, ddl).coalesce(1)
    with pytest.raises(Exception, match=message):
        write(df, tmp_path / "bad", **options)
    assert_nothing_written(tmp_path / "bad")


@pytest.mark.parametrize(
    "ddl,options,message",
    [
        ("x string", {"batch_size": 2}, "column 'x' has type string.*accepted"),
        ("x map<string,int>", {"batch_size": 2}, "column 'x' has type map"),
        ("k int, x array<float>", {"name_col": "k"}, "key column must be a string"),
        ("x array<float>", {}, "exactly one of batch_size"),
        ("x array<float>", {"batch_size": 2, "name_col": "x"}, "exactly one of batch_size"),
        ("x array<float>", {"batch_size": 0}, "batch_size=0"),
        ("x array<float>", {"batch_size": 2, "dtype": "F8"}, "valid dtypes are F16, F32"),
        ("x array<float>", {"batch_size": 2, "tail_strategy": "keep"}, "write, drop, pad"),
        ("x array<float>", {"batch_size": 2, "bogus": 1}, "unknown option.*bogus"),
        (
            "k string, x array<float>",
            {"name_col": "k", "target_shard_size_mb": 10},
            "between 50 and 1000",
        ),
        ("x array<float>", {"batch_size": 2, "metadata": "[1]"}, "metadata"),
        ("x array<float>", {"batch_size": 2, "columns": "y"}, r"column\(s\) \['y'\]"),
    ],
)
def test_bad_plans_are_refused_before_writing(spark, tmp_path, ddl, options, message):
    df = spark.createDataFrame([], ddl)
    with pytest.raises(Exception, match=message):
        write(df, tmp_path / "plan", **options)
    assert_nothing_written(tmp_path / "plan")


def test_empty_dataframe_gives_a_valid_empty_dataset(spark, tmp_path, repo_root):
    write(spark.createDataFrame([], "x array<float>"), tmp_path / "e", batch_size=4)
    m = manifest(tmp_path / "e")
    jsonschema.validate(m, json.loads((repo_root / "manifest-jsonschema.json").read_text()))
    assert m["total_samples"] == 0 and m["shards"] == [] and not shards(tmp_path / "e")
    write(spark.createDataFrame([], "k string, x array<float>"), tmp_path / "kv", name_col="k")
    assert manifest(tmp_path / "kv")["total_samples"] == 0
    assert pq.read_table(tmp_path / "kv" / "_tensor_index.parquet").num_rows == 0


def test_sql_temporary_view_insert(spark, tmp_path):
    out = tmp_path / "sql"
    spark.sql(
        f"CREATE OR REPLACE TEMPORARY VIEW acts (v array<float>) USING safetensors OPTIONS (path '{out}', batch_size '2')"
    )
    spark.sql("INSERT INTO acts SELECT array(cast(id as float)) FROM range(4)")
    assert manifest(out)["total_samples"] == 4
    spark.sql("INSERT OVERWRITE TABLE acts SELECT array(cast(id as float)) FROM range(2)")
    assert manifest(out)["total_samples"] == 2
