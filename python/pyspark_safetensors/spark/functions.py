"""Spark SQL functions for Tensor Structs, from Python.

``arr_to_st``, ``st_to_array``, ``st_shape``, ``st_dtype`` and ``st_numel`` return
``Column``s. When the JVM shim is loaded in the session (``with_shim(builder)``, or
``spark.sql.extensions=io.github.pysparksafetensors.SafetensorsExtensions`` plus the jar)
they call its Catalyst expressions, which run inside the JVM with codegen; otherwise they
fall back to vectorised Arrow UDFs built on the format core. Both give identical bytes and
values, and the same errors for bad input (null elements, shape/element-count mismatch,
integer overflow, unknown dtype). A null array or struct gives null.

>>> from pyspark.sql import SparkSession
>>> from pyspark_safetensors.functions import arr_to_st, st_to_array, with_shim
>>> spark = with_shim(SparkSession.builder.master("local[2]")).getOrCreate()
>>> df = spark.range(4).selectExpr("array(cast(id as float), 0.5f) AS x")
>>> df.select(arr_to_st("x", [2], "F16").alias("t")).select(st_to_array("t")).first()[0]
[0.0, 0.5]
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..format.casts import cast_array
from ..format.dtypes import DType, get_dtype
from ..format.errors import PysparkSafetensorsError
from .columns import first_null
from .dtypes import ELEMENT_DTYPES
from .shim import SHIM_EXTENSIONS, ShimSessionError, shim_loaded
from .tensor_struct import (
    TENSOR_STRUCT_DDL,
    assemble_tensor_structs,
)


class TensorFunctionError(PysparkSafetensorsError, ValueError):
    """Bad input to a tensor function; the message starts with the function's name."""


def _jvm(jvm: bool | None) -> bool:
    if jvm is None:
        jvm = shim_loaded()
    if jvm and not shim_loaded():
        raise ShimSessionError(
            f"the JVM shim is not loaded in this session; start it with with_shim(builder) "
            f"(spark.sql.extensions={SHIM_EXTENSIONS} and the jar on spark.jars)"
        )
    if not jvm:
        from pyspark.sql import functions as F

        if not hasattr(F, "arrow_udf"):  # the Arrow UDFs arrived in Spark 4.1
            import pyspark

            raise ShimSessionError(
                f"the tensor functions need the JVM shim on Spark {pyspark.__version__} (the "
                "Arrow UDF fallback needs Spark 4.1 or newer); start the session with "
                "with_shim(builder)"
            )
    return jvm


# ---------------------------------------------------------------- Column functions


def arr_to_st(col, shape=None, dtype: str = "F32", *, jvm: bool | None = None):
    """A numeric array column as a Tensor Struct of ``dtype`` (one of the twelve writable
    dtypes, case-insensitive).

    ``shape``: a list of ints (the same for every row), an ``array<int>`` Column (per row),
    or None for 1-D ``[len]``. Its element count must match each array. F16/BF16 round to
    nearest even; integer dtypes are exact (overflow, fractions, NaN are errors).
    ``jvm``: None uses the shim when loaded; False forces the Arrow UDF; True requires the shim.
    """
    from pyspark.sql import Column
    from pyspark.sql import functions as F

    dt = _dtype("arr_to_st", dtype)
    fixed = None
    if shape is not None and not isinstance(shape, (Column, str)):
        fixed = tuple(int(d) for d in shape)
        if any(d < 0 for d in fixed):
            raise TensorFunctionError(f"arr_to_st: shape {list(fixed)} has a negative dimension")
    col = _column(col)
    shape_col = _column(shape)
    if _jvm(jvm):
        if shape is None:
            return F.call_function("arr_to_st", col, F.lit(dt.name))
        if fixed is not None:
            shape_col = (
                F.array(*[F.lit(d) for d in fixed]) if fixed else F.array().cast("array<int>")
            )
        return F.call_function("arr_to_st", col, shape_col, F.lit(dt.name))
    if shape_col is None or fixed is not None:

        def encode_fixed(values: pa.Array) -> pa.Array:
            return encode_arrow(values, fixed, dt.name)

        return F.arrow_udf(encode_fixed, TENSOR_STRUCT_DDL)(col)

    def encode_rows(values: pa.Array, shapes: pa.Array) -> pa.Array:
        return encode_arrow(values, shapes, dt.name)

    return F.arrow_udf(encode_rows, TENSOR_STRUCT_DDL)(col, shape_col.cast("array<int>"))


def st_to_array(col, element: str = "float", *, jvm: bool | None = None):
    """A Tensor Struct column's values as a flat array of ``element`` (float, double,
    int, long, short, byte); decoded from any of the twelve dtypes, integers exactly."""
    from pyspark.sql import functions as F

    element = _element("st_to_array", element)
    col = _column(col)
    if _jvm(jvm):
        return F.call_function("st_to_array", col, F.lit(element))

    def decode(structs: pa.Array) -> pa.Array:
        return decode_arrow(structs, element)

    return F.arrow_udf(decode, f"array<{element}>")(col)


def st_shape(col, *, jvm: bool | None = None):
    """A Tensor Struct column's shape (``array<int>``)."""
    return _field("st_shape", "shape", col, jvm)


def st_dtype(col, *, jvm: bool | None = None):
    """A Tensor Struct column's dtype name."""
    return _field("st_dtype", "dtype", col, jvm)


def st_numel(col, *, jvm: bool | None = None):
    """A Tensor Struct column's element count (``long``), checked against its data length."""
    from pyspark.sql import functions as F

    col = _column(col)
    if _jvm(jvm):
        return F.call_function("st_numel", col)
    return F.arrow_udf(numel_arrow, "long")(col)


def _field(function: str, field: str, col, jvm):
    from pyspark.sql import functions as F

    col = _column(col)
    return F.call_function(function, col) if _jvm(jvm) else col.getField(field)


def _column(col):
    from pyspark.sql import functions as F

    return F.col(col) if isinstance(col, str) else col


# ---------------------------------------------------------------- Arrow kernels


def _dtype(function: str, name: str) -> DType:
    try:
        return get_dtype(name, writable=True)
    except ValueError as e:
        raise TensorFunctionError(f"{function}: {e}") from None


def _element(function: str, element: str) -> str:
    key = str(element).strip().lower()
    if key not in ELEMENT_DTYPES:
        raise TensorFunctionError(
            f"{function}: unknown element type {element!r}; valid: {', '.join(ELEMENT_DTYPES)}"
        )
    return key


def _list_offsets(lengths: np.ndarray) -> np.ndarray:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets


def _products(shapes: pa.ListArray, function: str) -> np.ndarray:
    """Element counts of per-row shapes (null rows count 0); no null or negative dims."""
    dims = shapes.flatten()
    if dims.null_count:
        raise TensorFunctionError(f"{function}: shape has a null dimension")
    d = dims.to_numpy(zero_copy_only=False).astype(np.int64)
    if (d < 0).any():
        raise TensorFunctionError(f"{function}: shape dimension {int(d[d < 0][0])} is negative")
    ndim = pc.list_value_length(shapes).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    starts = _list_offsets(ndim)[:-1]
    out = np.ones(len(ndim), dtype=np.int64)
    has = ndim > 0
    if has.any():  # reduceat over the non-empty shapes; an empty shape's product is 1
        out[has] = np.multiply.reduceat(d, starts[has]) if d.size else 1
    return out


def _shape_list(shape: tuple[int, ...], rows: int) -> pa.ListArray:
    offsets = pa.array(np.arange(rows + 1, dtype=np.int32) * len(shape))
    return pa.ListArray.from_arrays(offsets, pa.array(np.tile(np.asarray(shape, np.int32), rows)))


def encode_arrow(values: pa.Array, shape, dtype: str) -> pa.StructArray:
    """``arr_to_st`` on Arrow: a list array of numbers -> Tensor Structs of ``dtype``.

    ``shape``: a tuple (every row), a list array (per row) or None (``[len]``). Rows whose
    array or shape is null are null.
    """
    dt = _dtype("arr_to_st", dtype)
    rows = len(values)
    valid = values.is_valid().to_numpy(zero_copy_only=False)
    lengths = (
        pc.list_value_length(values).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    )
    flat = values.flatten()
    if flat.null_count:
        at, starts = first_null(flat), _list_offsets(lengths)
        row = int(np.searchsorted(starts, at, side="right") - 1)
        raise TensorFunctionError(
            f"arr_to_st: null element at index {at - int(starts[row])} of row {row}; "
            "tensors cannot hold nulls"
        )
    if shape is None:
        shapes = pa.ListArray.from_arrays(
            pa.array(np.arange(rows + 1, dtype=np.int32)), pa.array(lengths.astype(np.int32))
        )
        numel = lengths
    elif isinstance(shape, tuple):
        shapes = _shape_list(shape, rows)
        numel = np.full(rows, int(np.prod(shape, dtype=np.int64)), dtype=np.int64)
    else:
        shapes = shape.cast(pa.list_(pa.int32()))
        valid = valid & shapes.is_valid().to_numpy(zero_copy_only=False)
        numel = _products(shapes, "arr_to_st")
    bad = np.flatnonzero(valid & (numel != lengths))
    if bad.size:
        r = int(bad[0])
        raise TensorFunctionError(
            f"arr_to_st: shape {shapes[r].as_py()} holds {int(numel[r])} elements, the array has {int(lengths[r])}"
        )
    x = flat.to_numpy(zero_copy_only=False)
    data = np.ascontiguousarray(cast_array(x, dt, where="arr_to_st"))
    byte_lengths = np.where(valid, lengths, 0) * dt.itemsize
    if not valid.all():  # drop the elements of null rows (their list slots may hold values)
        data = data[np.repeat(valid, lengths)]
    offsets = _list_offsets(byte_lengths)
    if offsets[-1] > np.iinfo(np.int32).max:
        raise TensorFunctionError("arr_to_st: more than 2 GB of tensor data in one Arrow batch")
    mask = pa.array(~valid) if not valid.all() else None
    binary = pa.Array.from_buffers(
        pa.binary(),
        rows,
        [None, pa.py_buffer(offsets.astype(np.int32).tobytes()), pa.py_buffer(data.view(np.uint8))],
    )
    return assemble_tensor_structs(binary, shapes, dt.name, mask)


def _parts(structs: pa.StructArray, function: str):
    """(valid, data, shapes, dtype names, element counts) of Tensor Structs, checked."""
    valid = structs.is_valid().to_numpy(zero_copy_only=False)
    if not isinstance(structs.type, pa.StructType) or {f.name for f in structs.type} != {
        "data",
        "shape",
        "dtype",
    }:
        raise TensorFunctionError(
            f"{function}: expected a Tensor Struct {TENSOR_STRUCT_DDL}, got {structs.type}"
        )
    children = dict(zip([f.name for f in structs.type], structs.flatten(), strict=True))
    for name, child in children.items():
        missing = valid & ~child.is_valid().to_numpy(zero_copy_only=False)
        if missing.any():
            raise TensorFunctionError(
                f"{function}: the Tensor Struct in row {int(np.argmax(missing))} has a null {name}"
            )
    data, shapes = children["data"], children["shape"]
    names = children["dtype"].to_numpy(zero_copy_only=False)
    numel = _products(shapes, function)
    sizes = np.zeros(len(structs), dtype=np.int64)
    for name in set(names[valid]):
        rows = valid & (names == name)
        sizes[rows] = _dtype(function, name).itemsize
    nbytes = pc.binary_length(data).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    bad = np.flatnonzero(valid & (nbytes != numel * sizes))
    if bad.size:
        r = int(bad[0])
        raise TensorFunctionError(
            f"{function}: data has {int(nbytes[r])} bytes, shape {shapes[r].as_py()} of {names[r]} "
            f"needs {int(numel[r] * sizes[r])}"
        )
    return valid, data, names, numel


def decode_arrow(structs: pa.StructArray, element: str = "float") -> pa.ListArray:
    """``st_to_array`` on Arrow: Tensor Structs -> flat list arrays of ``element``."""
    element = _element("st_to_array", element)
    target = get_dtype(ELEMENT_DTYPES[element])
    valid, data, names, numel = _parts(structs, "st_to_array")
    numel = np.where(valid, numel, 0)
    offsets = _list_offsets(numel)
    out = np.empty(int(offsets[-1]), dtype=target.numpy)
    for name in set(names[valid]):
        rows = valid & (names == name)
        source = get_dtype(name)
        raw = data.filter(pa.array(rows))  # this dtype's rows, their bytes back to back
        _, offs, buf = raw.buffers()
        ends = np.frombuffer(offs, dtype=np.int32, count=len(raw) + 1, offset=4 * raw.offset)
        start, stop = int(ends[0]), int(ends[-1])
        x = np.frombuffer(
            buf, dtype=source.numpy, count=(stop - start) // source.itemsize, offset=start
        )
        values = cast_array(x, target, where="st_to_array")
        if rows.all():
            out[:] = values
        else:  # scatter this dtype's rows to their places in row order
            k = numel[rows]
            dest = np.repeat(offsets[:-1][rows] - _list_offsets(k)[:-1], k) + np.arange(
                int(k.sum())
            )
            out[dest] = values
    mask = pa.array(~valid) if not valid.all() else None
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(out), mask=mask)


def numel_arrow(structs: pa.Array) -> pa.Array:
    """``st_numel`` on Arrow: element counts of Tensor Structs (null for null structs)."""
    valid, _, _, numel = _parts(structs, "st_numel")
    return pa.array(numel, mask=~valid)
