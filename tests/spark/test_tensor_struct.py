"""The Tensor Struct module: its spellings agree, its builders give what Spark expects."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pyarrow as pa
import pytest
from pyspark.sql.types import ArrayType, LongType, StructField, StructType

from pyspark_safetensors.spark.tensor_struct import (
    TENSOR_STRUCT_ARROW,
    TENSOR_STRUCT_DDL,
    TENSOR_STRUCT_TYPE,
    TensorStructError,
    is_tensor_struct,
    struct_shape,
    tensor_structs_of_arrays,
    tensor_structs_of_rows,
)


def test_spellings_agree():
    from pyspark.sql.pandas.types import to_arrow_type

    assert TENSOR_STRUCT_TYPE.simpleString() == TENSOR_STRUCT_DDL.replace(" ", "")
    assert to_arrow_type(TENSOR_STRUCT_TYPE) == TENSOR_STRUCT_ARROW
    assert is_tensor_struct(TENSOR_STRUCT_TYPE)
    long_shapes = StructType(
        [
            f if f.name != "shape" else StructField("shape", ArrayType(LongType()))
            for f in TENSOR_STRUCT_TYPE
        ]
    )
    assert is_tensor_struct(long_shapes)
    assert not is_tensor_struct(StructType(TENSOR_STRUCT_TYPE.fields[:2]))
    assert not is_tensor_struct(ArrayType(LongType()))


def test_arrays_of_different_shapes_round_trip():
    arrays = [
        np.arange(6, dtype=np.float32).reshape(2, 3),
        np.zeros((0, 3), np.float32),
        np.array([1.5], np.float32),
    ]
    structs = tensor_structs_of_arrays(arrays)
    assert structs.type == TENSOR_STRUCT_ARROW
    rows = structs.to_pylist()
    assert [r["shape"] for r in rows] == [[2, 3], [0, 3], [1]]
    assert {r["dtype"] for r in rows} == {"F32"}
    for r, a in zip(rows, arrays, strict=True):
        assert np.frombuffer(r["data"], np.float32).reshape(r["shape"]).tolist() == a.tolist()


def test_rows_share_one_buffer_and_name_their_dtype():
    values = np.arange(12, dtype=np.float32).astype(ml_dtypes.bfloat16).reshape(4, 3)
    structs = tensor_structs_of_rows(values)
    assert structs.type == TENSOR_STRUCT_ARROW
    assert structs.field("dtype").to_pylist() == ["BF16"] * 4
    assert structs.field("shape").to_pylist() == [[3]] * 4
    got = np.frombuffer(b"".join(structs.field("data").to_pylist()), ml_dtypes.bfloat16)
    assert got.tolist() == values.reshape(-1).tolist()
    assert tensor_structs_of_rows(np.zeros((0, 2), np.int64), "I64").to_pylist() == []
    assert tensor_structs_of_arrays([], "F16").type == TENSOR_STRUCT_ARROW


def test_dimension_beyond_int32_is_refused_naming_the_tensor():
    with pytest.raises(TensorStructError, match=r"tensor 'w'.*array<int>"):
        struct_shape((2**31, 0), "tensor 'w'")
    assert isinstance(pa.array([], TENSOR_STRUCT_ARROW), pa.StructArray)
