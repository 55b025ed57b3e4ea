"""The Tensor Struct ``struct<data: binary, shape: array<int>, dtype: string>``: one tensor
in one Spark value (raw little-endian bytes, dimensions, safetensors dtype name).

The one home of its spellings (DDL, Spark type, Arrow type), its predicate and its Arrow
builders; writers accept it, the reader, the SQL functions and the extraction produce it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    DataType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
)

from ..format.dtypes import dtype_of
from ..format.errors import PysparkSafetensorsError

TENSOR_STRUCT_DDL = "struct<data: binary, shape: array<int>, dtype: string>"
"""The Tensor Struct as Spark DDL (for ``mapInArrow`` schemas and UDF return types)."""

TENSOR_STRUCT_TYPE = StructType(
    [
        StructField("data", BinaryType()),
        StructField("shape", ArrayType(IntegerType())),
        StructField("dtype", StringType()),
    ]
)
"""The Tensor Struct as a Spark type."""

TENSOR_STRUCT_ARROW = pa.struct(
    [("data", pa.binary()), ("shape", pa.list_(pa.int32())), ("dtype", pa.string())]
)
"""The Tensor Struct as an Arrow type (what Spark hands Python for ``TENSOR_STRUCT_TYPE``)."""

MAX_DIMENSION = 2**31 - 1
"""The largest dimension ``shape: array<int>`` holds."""


class TensorStructError(PysparkSafetensorsError, ValueError):
    """A tensor the Tensor Struct cannot hold."""


def is_tensor_struct(t: DataType) -> bool:
    """Whether a Spark type is a Tensor Struct (fields in any order; ``array<long>``
    shapes are accepted as input)."""
    if not isinstance(t, StructType):
        return False
    fields = {f.name: f.dataType for f in t.fields}
    return (
        set(fields) == {"data", "shape", "dtype"}
        and isinstance(fields["data"], BinaryType)
        and isinstance(fields["shape"], ArrayType)
        and isinstance(fields["shape"].elementType, (IntegerType, LongType))
        and isinstance(fields["dtype"], StringType)
    )


def struct_shape(shape: Sequence[int], where: str) -> list[int]:
    """``shape`` as a Tensor Struct shape; a dimension above 2^31 - 1 is refused naming
    ``where`` (safetensors dimensions go up to 2^64 - 1; in practice only empty tensors
    have such dimensions)."""
    if any(d > MAX_DIMENSION for d in shape):
        raise TensorStructError(
            f"{where}: shape {list(shape)} has a dimension above 2^31 - 1, which the Tensor "
            "Struct's array<int> shape cannot hold; read it with view=tensors (array<long>)"
        )
    return list(shape)


def repeated_string(value: str, rows: int) -> pa.StringArray:
    """``value`` ``rows`` times, built from two buffers (no Python object per row)."""
    raw = value.encode()
    offsets = pa.py_buffer((np.arange(rows + 1, dtype=np.int32) * len(raw)).tobytes())
    return pa.StringArray.from_buffers(rows, offsets, pa.py_buffer(raw * rows))


def assemble_tensor_structs(
    data: pa.Array, shapes: pa.Array, dtypes: str | pa.Array, mask: pa.Array | None = None
) -> pa.StructArray:
    """Tensor Structs from their children: ``data`` (binary or large binary), ``shapes``
    (lists of int32), and one dtype name for every row or a string array of them;
    ``mask`` marks null rows."""
    if isinstance(dtypes, str):
        dtypes = repeated_string(dtypes, len(data))
    return pa.StructArray.from_arrays(
        [data, shapes, dtypes], names=["data", "shape", "dtype"], mask=mask
    )


def tensor_structs_of_arrays(
    arrays: Sequence[np.ndarray], dtype: str | None = None
) -> pa.StructArray:
    """One Tensor Struct per numpy array (shapes may differ); ``dtype`` names the arrays'
    safetensors dtype, by default the one their numpy dtype holds (F16/BF16 alike)."""
    if dtype is None:
        dtype = dtype_of(arrays[0]).name if len(arrays) else "F32"
    sizes = np.array([a.nbytes for a in arrays], dtype=np.int64)
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    wide = offsets[-1] > np.iinfo(np.int32).max
    buffer = (
        np.concatenate([np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in arrays])
        if len(arrays)
        else np.empty(0, np.uint8)
    )
    data = pa.Array.from_buffers(
        pa.large_binary() if wide else pa.binary(),
        len(arrays),
        [None, pa.py_buffer(offsets.astype(np.int64 if wide else np.int32)), pa.py_buffer(buffer)],
    )
    ranks = np.array([a.ndim for a in arrays], dtype=np.int64)
    shape_offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
    np.cumsum(ranks, out=shape_offsets[1:])
    dims = [d for i, a in enumerate(arrays) for d in struct_shape(a.shape, f"array {i}")]
    shapes = pa.ListArray.from_arrays(pa.array(shape_offsets), pa.array(dims, pa.int32()))
    return assemble_tensor_structs(data, shapes, dtype)


def tensor_structs_of_rows(values: np.ndarray, dtype: str | None = None) -> pa.StructArray:
    """One Tensor Struct per row of ``values`` ``[rows, *sample]`` (one shape for all),
    built over a single contiguous buffer."""
    if dtype is None:
        dtype = dtype_of(values).name
    rows = values.shape[0]
    per = math.prod(values.shape[1:]) * values.dtype.itemsize
    flat = np.ascontiguousarray(values).reshape(-1).view(np.uint8)
    offsets = np.arange(rows + 1, dtype=np.int64) * per
    wide = rows and offsets[-1] > np.iinfo(np.int32).max
    data = pa.Array.from_buffers(
        pa.large_binary() if wide else pa.binary(),
        rows,
        [None, pa.py_buffer(offsets.astype(np.int64 if wide else np.int32)), pa.py_buffer(flat)],
    )
    sample = struct_shape(values.shape[1:], "a column's samples")
    shapes = pa.ListArray.from_arrays(
        pa.array(np.arange(rows + 1, dtype=np.int32) * len(sample)),
        pa.array(np.tile(np.array(sample, np.int32), rows), pa.int32()),
    )
    return assemble_tensor_structs(data, shapes, dtype)


__all__ = [
    "MAX_DIMENSION",
    "TENSOR_STRUCT_ARROW",
    "TENSOR_STRUCT_DDL",
    "TENSOR_STRUCT_TYPE",
    "TensorStructError",
    "assemble_tensor_structs",
    "is_tensor_struct",
    "repeated_string",
    "struct_shape",
    "tensor_structs_of_arrays",
    "tensor_structs_of_rows",
]
