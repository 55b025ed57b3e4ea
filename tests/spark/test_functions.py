"""Tensor SQL functions: the JVM shim (built by jvm-shim/build.sh) and the Arrow-UDF
fallback give the format core's bytes and agree with each other."""

from __future__ import annotations

import json
import zipfile

import numpy as np
import pyarrow as pa
import pytest
import torch
from pyspark.sql import functions as F

from pyspark_safetensors.format.casts import cast_array
from pyspark_safetensors.format.dtypes import WRITABLE, get_dtype
from pyspark_safetensors.functions import (
    TensorFunctionError,
    arr_to_st,
    shim_jar,
    shim_loaded,
    st_dtype,
    st_numel,
    st_shape,
    st_to_array,
)
from pyspark_safetensors.spark.compat import from_arrow

pytestmark = [pytest.mark.spark, pytest.mark.jvm]

INTEGER = [d for d in WRITABLE if d[0] in "IU"]
FLOAT = [d for d in WRITABLE if d not in INTEGER]
ARROW = {"float": pa.float32(), "double": pa.float64(), "int": pa.int32(), "long": pa.int64(),
         "short": pa.int16(), "byte": pa.int8()}  # fmt: skip

# float32 values that exercise rounding: ties to even in F16 and BF16, the F16 overflow
# midpoint, subnormals on both sides, signed zeros, infinities and NaN.
SPECIAL = np.array(
    [0.0, -0.0, 1.0, -2.5, 65504.0, 65519.996, 65520.0, -65520.0, 1e-8, 2.0**-25, 3 * 2.0**-25,
     2.0**-24, 6.1e-5, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8,
     3.4e38, -3.4e38, 1.17e-38, np.inf, -np.inf, np.nan],
    dtype=np.float32,
)  # fmt: skip


@pytest.fixture(scope="module")
def spark():
    """The run's shared session with the shim loaded (the jar must have been built by the
    set-up)."""
    from spark_sessions import spark_session

    return spark_session("shim")


def frame(spark, rows: list[np.ndarray], element: str):
    """A DataFrame with one array column ``x`` of Spark type ``element``."""
    return from_arrow(
        spark, pa.table({"x": pa.array([r.tolist() for r in rows], pa.list_(ARROW[element]))})
    )


# The Arrow UDF fallback needs Spark 4.1 (pyspark.sql.functions.arrow_udf); before that the
# JVM shim is the only implementation, and these tests check it alone.
SIDES = (True, False) if hasattr(F, "arrow_udf") else (True,)


def collect_each(df, columns: dict) -> dict[str, list]:
    """Each of ``columns`` (name -> ``column(jvm)``) collected with the JVM shim and with
    the fallback (where this Spark has one), all columns in one job per side; the two
    sides must agree. Returns the JVM side's values by name."""
    sides = {}
    for jvm in SIDES:
        rows = df.select(*[column(jvm).alias(name) for name, column in columns.items()]).collect()
        sides[jvm] = {name: [r[name] for r in rows] for name in columns}
    for name in columns if False in sides else ():
        jvm, fallback = sides[True][name], sides[False][name]
        assert len(jvm) == len(fallback), name
        for a, b in zip(jvm, fallback, strict=True):
            if isinstance(a, list):
                np.testing.assert_array_equal(
                    np.asarray(a, dtype=float), np.asarray(b, dtype=float), err_msg=name
                )
            else:
                assert a == b, name
    return sides[True]


def collect_both(df, column):
    """``column(jvm)`` collected with the JVM shim and with the fallback (``collect_each``)."""
    return collect_each(df, {"value": column})["value"]


def expected_bytes(row: np.ndarray, dtype: str) -> bytes:
    return cast_array(row, dtype).tobytes()


def test_jar_registers_functions_and_the_data_source(spark, tmp_path):
    with zipfile.ZipFile(shim_jar()) as jar:
        names = jar.namelist()
        services = jar.read(f"META-INF/services/{DATA_SOURCE_REGISTER}").decode().split()
    assert "io/github/pysparksafetensors/SafetensorsExtensions.class" in names
    assert services == ["io.github.pysparksafetensors.SafetensorsSource"]
    assert shim_loaded(spark)
    for fn in ("arr_to_st", "st_to_array", "st_shape", "st_dtype", "st_numel"):
        assert spark.catalog.functionExists(fn)
    # with the jar, format("safetensors") is the JVM source, which writes Tensor Structs
    df = spark.range(6).selectExpr("arr_to_st(array(cast(id as float), 1.0f), 'F16') AS t")
    df.write.format("safetensors").option("batch_size", 3).mode("overwrite").save(
        str(tmp_path / "d")
    )
    manifest = json.loads((tmp_path / "d" / "dataset_manifest.json").read_text())
    assert manifest["created_by"].endswith("(JVM)") and manifest["total_samples"] == 6


DATA_SOURCE_REGISTER = "org.apache.spark.sql.sources.DataSourceRegister"


@pytest.mark.parametrize("element", ["float", "double"])
def test_float_sources_every_dtype(spark, element):
    rng = np.random.default_rng(0)
    rows = [
        SPECIAL,
        rng.standard_normal(64).astype(np.float32) * 1000,
        rng.standard_normal(7) * 1e-6,
    ]
    rows = [r.astype(np.float32 if element == "float" else np.float64) for r in rows]
    df = frame(spark, rows, element)
    columns = {d: lambda jvm, d=d: arr_to_st("x", None, d, jvm=jvm) for d in FLOAT}
    for dtype, got in collect_each(df, columns).items():
        for row, t in zip(rows, got, strict=True):
            assert t.dtype == dtype and t.shape == [len(row)]
            assert bytes(t.data) == expected_bytes(row, dtype), dtype
    # SQL gives the same struct as the binding
    sql = df.selectExpr("arr_to_st(x, array(size(x)), 'bf16') AS t").collect()
    assert [bytes(r.t.data) for r in sql] == [expected_bytes(r, "BF16") for r in rows]


@pytest.mark.parametrize("element", ["byte", "short", "int", "long", "float", "double"])
def test_integral_values_every_dtype(spark, element):
    rows = [np.arange(0, 128, 3), np.array([127, 0, 1, 64]), np.array([5])]
    rows = [r.astype(ARROW[element].to_pandas_dtype()) for r in rows]
    df = frame(spark, rows, element)
    columns = {d: lambda jvm, d=d: arr_to_st("x", None, d, jvm=jvm) for d in WRITABLE}
    for dtype, got in collect_each(df, columns).items():
        assert [bytes(t.data) for t in got] == [expected_bytes(r, dtype) for r in rows], dtype


def test_half_rounding_matches_torch(spark):
    x = np.concatenate(
        [SPECIAL[:-1], np.random.default_rng(1).standard_normal(4096).astype(np.float32)]
    )
    got = (
        frame(spark, [x], "float")
        .selectExpr("arr_to_st(x, 'F16') AS h", "arr_to_st(x, 'BF16') AS b")
        .first()
    )
    t = torch.from_numpy(x)
    assert bytes(got.h.data) == t.to(torch.float16).numpy().tobytes()
    assert bytes(got.b.data) == t.to(torch.bfloat16).view(torch.int16).numpy().tobytes()
    # NaN keeps its sign and quiet payload in F16, and becomes 0xFFFF in BF16, as in the core
    nan = np.array([np.nan, -np.nan], np.float32)
    got = (
        frame(spark, [nan], "float")
        .selectExpr("arr_to_st(x, 'F16') AS h", "arr_to_st(x, 'BF16') AS b")
        .first()
    )
    assert bytes(got.h.data) == expected_bytes(nan, "F16")
    assert bytes(got.b.data) == expected_bytes(nan, "BF16")


@pytest.mark.parametrize("dtype", INTEGER)
def test_integer_range_is_exact(spark, dtype):
    info = np.iinfo(get_dtype(dtype).numpy)
    lo, hi = int(info.min), min(int(info.max), 2**63 - 1)
    df = from_arrow(spark, pa.table({"x": pa.array([[lo, hi]], pa.list_(pa.int64()))}))
    t = collect_both(df, lambda jvm: arr_to_st("x", [2], dtype, jvm=jvm))[0]
    assert bytes(t.data) == np.array([lo, hi]).astype(info.dtype).tobytes()
    beyond = {"U64": [-1], "I64": []}.get(dtype, [lo - 1, hi + 1])  # what a long can hold
    for value in beyond:
        bad = from_arrow(spark, pa.table({"x": pa.array([[value]], pa.list_(pa.int64()))}))
        for jvm in SIDES:
            with pytest.raises(Exception, match=f"overflows {dtype}"):
                bad.select(arr_to_st("x", None, dtype, jvm=jvm)).collect()


def test_float_to_integer_errors(spark):
    for values, message in [
        ([1.5], "not an integer"),
        ([float("nan")], "not finite"),
        ([300.0], "overflows U8"),
    ]:
        df = frame(spark, [np.array(values)], "double")
        for jvm in SIDES:
            with pytest.raises(Exception, match=message):
                df.select(arr_to_st("x", None, "U8", jvm=jvm)).collect()


def test_shapes(spark):
    rows = [np.arange(6, dtype=np.float32), np.arange(6, 12, dtype=np.float32)]
    df = frame(spark, rows, "float").withColumn("s", F.array(F.lit(3), F.lit(2)))
    shapes = {"literal": [2, 3], "column": "s", "long_column": F.col("s").cast("array<long>")}
    columns = {k: lambda jvm, s=s: arr_to_st("x", s, "F32", jvm=jvm) for k, s in shapes.items()}
    for name, got in collect_each(df, columns).items():
        assert {tuple(t.shape) for t in got} == ({(2, 3)} if name == "literal" else {(3, 2)})
    scalar = collect_both(
        df.selectExpr("slice(x, 1, 1) AS x"), lambda jvm: arr_to_st("x", [], "F64", jvm=jvm)
    )
    assert scalar[0].shape == [] and np.frombuffer(scalar[0].data, "<f8").tolist() == [0.0]
    for shape in ([4], [2, 2]):
        for jvm in SIDES:
            with pytest.raises(Exception, match="holds 4 elements, the array has 6"):
                df.select(arr_to_st("x", shape, "F32", jvm=jvm)).collect()


def test_nulls(spark):
    df = from_arrow(spark, pa.table({"x": pa.array([[1.0, 2.0], None], pa.list_(pa.float32()))}))
    got = collect_both(df, lambda jvm: arr_to_st("x", [2], "F16", jvm=jvm))
    assert got[1] is None and bytes(got[0].data) == expected_bytes(
        np.array([1.0, 2.0], np.float32), "F16"
    )
    structs = df.select(arr_to_st("x", [2], "F16").alias("t"))
    assert collect_both(structs, lambda jvm: st_to_array("t", jvm=jvm))[1] is None
    assert collect_both(structs, lambda jvm: st_numel("t", jvm=jvm)) == [2, None]
    assert collect_both(structs, lambda jvm: st_shape("t", jvm=jvm)) == [[2], None]
    assert collect_both(structs, lambda jvm: st_dtype("t", jvm=jvm)) == ["F16", None]
    holes = from_arrow(spark, pa.table({"x": pa.array([[1.0, None]], pa.list_(pa.float32()))}))
    for jvm in SIDES:
        with pytest.raises(Exception, match="null element at index 1"):
            holes.select(arr_to_st("x", None, "F32", jvm=jvm)).collect()


def test_bad_arguments(spark):
    with pytest.raises(TensorFunctionError, match="unknown dtype 'F8'"):
        arr_to_st("x", None, "F8")
    with pytest.raises(TensorFunctionError, match="unknown element type"):
        st_to_array("t", "half")
    with pytest.raises(Exception, match="unknown dtype 'x'; valid dtypes: F16"):
        spark.sql("SELECT arr_to_st(array(1.0f), 'x')").collect()
    with pytest.raises(Exception, match="accepted: array<float"):
        spark.sql("SELECT arr_to_st(array('a'), 'F32')").collect()
    with pytest.raises(Exception, match="expected a Tensor Struct"):
        spark.sql("SELECT st_to_array(named_struct('a', 1))").collect()
    bad = spark.sql("SELECT named_struct('data', X'0000', 'shape', array(3), 'dtype', 'F16') AS t")
    for jvm in SIDES:
        with pytest.raises(Exception, match="data has 2 bytes, shape \\[3\\] of F16 needs 6"):
            bad.select(st_to_array("t", jvm=jvm)).collect()


@pytest.mark.parametrize("dtype", WRITABLE)
def test_decode_every_dtype(spark, dtype):
    rows = [np.array([0, 1, 2, 100, 127], np.int64), np.array([3, 5], np.int64)]
    if dtype in FLOAT:
        rows.append(np.concatenate([SPECIAL, [0.1, 1e5]]))
    structs = frame(spark, rows, "double").select(arr_to_st("x", None, dtype).alias("t"))
    stored = [np.frombuffer(bytes(r.t.data), get_dtype(dtype).numpy) for r in structs.collect()]
    targets = {"float": "F32", "double": "F64"}
    columns = {e: lambda jvm, e=e: st_to_array("t", e, jvm=jvm) for e in targets}
    for element, got in collect_each(structs, columns).items():
        for values, s in zip(got, stored, strict=True):
            target = targets[element]
            np.testing.assert_array_equal(
                np.asarray(values, get_dtype(target).numpy), cast_array(s, target)
            )
    ints = structs.limit(2)
    columns = {
        e: lambda jvm, e=e: st_to_array("t", e, jvm=jvm) for e in ("byte", "short", "int", "long")
    }
    for element, got in collect_each(ints, columns).items():
        assert got == [r.tolist() for r in rows[:2]], element


def test_decode_errors(spark):
    fractions = frame(spark, [np.array([1.5, 300.0])], "double").select(
        arr_to_st("x", None, "F32").alias("t")
    )
    i32 = frame(spark, [np.array([200])], "int").select(arr_to_st("x", None, "I32").alias("t"))
    u64 = spark.sql("SELECT arr_to_st(array(9.3e18D), 'U64') AS t")  # fits U64, not a long
    for jvm in SIDES:
        with pytest.raises(Exception, match="not an integer"):
            fractions.select(st_to_array("t", "int", jvm=jvm)).collect()
        with pytest.raises(Exception, match="overflows I8"):
            i32.select(st_to_array("t", "byte", jvm=jvm)).collect()
        with pytest.raises(Exception, match="overflows I64"):
            u64.select(st_to_array("t", "long", jvm=jvm)).collect()
    assert collect_both(u64, lambda jvm: st_to_array("t", "double", jvm=jvm)) == [[9.3e18]]


def test_writer_and_reader_round_trip(spark, tmp_path):
    rows = [np.random.default_rng(i).standard_normal(12).astype(np.float32) for i in range(8)]
    df = frame(spark, rows, "float").select(arr_to_st("x", [3, 4], "BF16").alias("t"))
    df.write.format("safetensors").option("batch_size", 4).mode("overwrite").save(
        str(tmp_path / "d")
    )
    back = (
        spark.read.format("safetensors").option("tensor_format", "struct").load(str(tmp_path / "d"))
    )
    got = collect_both(back, lambda jvm: st_to_array("t", jvm=jvm))
    want = [cast_array(r, "BF16").astype(np.float32) for r in rows]
    assert sorted(map(tuple, got)) == sorted(map(tuple, (w.tolist() for w in want)))
    shapes = back.select(st_shape("t"), st_dtype("t"), st_numel("t")).distinct().collect()
    assert [tuple(r) for r in shapes] == [([3, 4], "BF16", 12)]


def test_scala_connector_spelling(spark):
    # arr_to_st(array, shape_array, dtype) with the shape as an array literal, and
    # st_to_array giving array<float>: SQL written for the Scala connector runs as it is.
    df = spark.sql(
        "SELECT st_to_array(arr_to_st(array(1.0f, 2.0f, 3.0f, 4.0f), array(4), 'F32')) AS a, "
        "arr_to_st(array(1.0f, 2.0f, 3.0f, 4.0f), array(2, 2), 'BF16') AS t"
    )
    assert df.schema["a"].dataType.simpleString() == "array<float>"
    row = df.first()
    assert row.a == [1.0, 2.0, 3.0, 4.0] and row.t.shape == [2, 2] and row.t.dtype == "BF16"
