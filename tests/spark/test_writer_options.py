"""Writer options: a plain dtype covers every numeric column with exact casts, integer
options are bounded, dtype names have aliases, unknown options get a suggestion."""

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from implementations import IMPLEMENTATIONS, require, writer
from pyspark_safetensors.spark.options import MAX_ROWS, OptionError, WriterOptions


def parse(**options):
    return WriterOptions.parse({"path": "out", **options})


@pytest.mark.parametrize(
    "options,message",
    [
        (
            {"batch_size": "99999999999999999999"},
            f"batch_size=99999999999999999999: must be between 1 and {MAX_ROWS}",
        ),
        ({"batch_size": str(2**31)}, f"between 1 and {MAX_ROWS}"),
        ({"batch_size": "1e3"}, "expected an integer"),
        ({"name_col": "k", "target_shard_size_mb": "1" + "0" * 40}, "between 50 and 1000"),
        ({"batch_size": "2", "shapes": json.dumps({"x": [2**40]})}, f"ints in 0..{MAX_ROWS}"),
        ({"batch_size": "2", "metadata": '{"k": NaN}'}, "NaN is not JSON"),
        ({"batch_size": "2", "metadata": '{"k": "\\ud800"}'}, "lone UTF-16 surrogate"),
        ({"batch_size": "2", "dtype": "fp17"}, "did you mean F16"),
        (
            {"batch_size": "2", "dtype": '{"x": "F4"}'},
            "dtype=.*F4.*: F4 can be read but not written; valid dtypes are F16",
        ),
        ({"batchsize": "2"}, r"batchsize \(did you mean batch_size\?\)"),
        ({"batch_size": "2", "dtpye": "F16"}, r"dtpye \(did you mean dtype\?\)"),
        ({"batch_size": "2", "duplicatestrategy": "fail", "kv_seperator": "_"}, r"kv_separator\?"),
    ],
)
def test_bad_options_are_refused_with_a_clear_message(options, message):
    with pytest.raises(OptionError, match=message):
        parse(**options)


@pytest.mark.parametrize(
    "given,canonical",
    [("fp16", "F16"), ("half", "F16"), ("torch.float16", "F16"), ("bfloat16", "BF16"),
     ("float", "F32"), ("float32", "F32"), ("double", "F64"), ("long", "I64"), ("uint8", "U8")],
)  # fmt: skip
def test_dtype_aliases_become_canonical_names(given, canonical):
    assert parse(batch_size="2", dtype=given).dtype == canonical
    assert parse(batch_size="2", dtype=json.dumps({"x": given})).column_dtypes == {"x": canonical}


def test_plain_dtype_covers_integer_columns():
    o = parse(batch_size="2", dtype="U8")
    assert o.target_dtype("id", "I64") == "U8" and o.target_dtype("vec", "F32") == "U8"
    o = parse(batch_size="2", dtype='{"vec": "F16"}')
    assert o.target_dtype("id", "I64") == "I64" and o.target_dtype("vec", "F32") == "F16"


# ------------------------------------------------------------------ through Spark


@pytest.fixture(params=IMPLEMENTATIONS)
def fmt(request, spark):
    """The implementation of the writer under test: the Python source, then the JVM one
    when the session's shim jar has it."""
    return require(spark, request.param)


def write(df, path, fmt="python", **options):
    writer(df, fmt).options(**options).mode("overwrite").save(str(path))


def frame(spark, ids):
    return spark.createDataFrame(
        [(i, [float(i), float(i) / 2], str(i)) for i in ids],
        "id long, vec array<double>, key string",
    ).coalesce(1)


@pytest.mark.spark
def test_plain_dtype_applies_to_every_numeric_column(spark, tmp_path, fmt):
    df = frame(spark, [0, 2, 4, 2048])
    write(df.select("id", "vec"), tmp_path / "f16", fmt, batch_size=4, dtype="half")
    m = json.loads((tmp_path / "f16" / "dataset_manifest.json").read_text())
    assert {c: s["dtype"] for c, s in m["schema"].items()} == {"id": "F16", "vec": "F16"}
    (shard,) = sorted(Path(tmp_path / "f16").glob("*.safetensors"))
    tensors = load_file(shard)
    assert tensors["id"].dtype == np.float16 and tensors["id"].tolist() == [0, 2, 4, 2048]

    write(
        frame(spark, [0, 2, 4, 200]),
        tmp_path / "u8",
        fmt,
        name_col="key",
        dtype="U8",
        columns="id,vec",
    )
    kv = {}
    for f in sorted(Path(tmp_path / "u8").glob("*.safetensors")):
        kv.update(load_file(f))
    assert kv["4__vec"].dtype == np.uint8 and kv["4__vec"].tolist() == [4, 2]
    assert kv["2__id"].dtype == np.uint8 and kv["2__id"].tolist() == 2


@pytest.mark.spark
@pytest.mark.parametrize(
    "ids,options,message",
    [
        ([1, 2049], {"batch_size": 2, "dtype": "F16"},
         r"column 'id' \(row 1 of this partition\): value 2049 .*not exactly representable in F16.*"
         r"applies to every numeric column"),
        ([3, 300], {"name_col": "key", "dtype": "U8", "columns": "id"},
         r"column 'id' \(key '300'\): value 300 .*overflows U8"),
    ],
)  # fmt: skip
def test_plain_dtype_casts_are_checked(spark, tmp_path, fmt, ids, options, message):
    df = frame(spark, ids)
    if "name_col" not in options:
        df = df.select("id", "vec")
    with pytest.raises(Exception, match=message):
        write(df, tmp_path / "bad", fmt, **options)
    assert not list((tmp_path / "bad").glob("*.safetensors"))
    assert not (tmp_path / "bad" / "dataset_manifest.json").exists()


@pytest.mark.spark
def test_unknown_option_is_refused_before_writing(spark, tmp_path, fmt):
    with pytest.raises(Exception, match=r"batch_szie \(did you mean batch_size\?\)"):
        write(frame(spark, [1]).select("vec"), tmp_path / "x", fmt, batch_szie="2")
    assert not list(Path(tmp_path).rglob("*.safetensors"))
