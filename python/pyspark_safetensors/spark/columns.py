"""From Spark columns to tensors: type planning on the driver, zero-copy Arrow decoding in
the tasks.

Accepted column types: numeric arrays (``array<float|double|int|long|short|byte>``),
nested numeric arrays (``array<array<...>>``), numeric scalars (per-sample shape ``[]``)
and Tensor Structs ``struct<data: binary, shape: array<int>, dtype: string>``.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import pyarrow as pa
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    ByteType,
    DataType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    ShortType,
    StringType,
    StructType,
)

from ..format import cast_array, get_dtype

NUMERIC = {
    FloatType: "F32",
    DoubleType: "F64",
    IntegerType: "I32",
    LongType: "I64",
    ShortType: "I16",
    ByteType: "I8",
}
ACCEPTED = (
    "array<float|double|int|long|short|byte> (nested arrays too), a numeric scalar, or a "
    "Tensor Struct struct<data: binary, shape: array<int>, dtype: string>"
)


class ColumnError(ValueError):
    """A column's type or data cannot be written as a tensor."""


@dataclass(frozen=True)
class ColumnPlan:
    """How one Spark column becomes a tensor."""

    name: str
    kind: Literal["array", "scalar", "struct"]
    depth: int
    """Nesting depth of arrays (0 for scalars and structs)."""
    source: str
    """Dtype of the Spark values (structs: of the data bytes, known only per row)."""
    target: str | None
    """Dtype written; None for structs without a dtype option (their own dtype is kept)."""
    shape: tuple[int, ...] | None
    """Per-sample shape from the ``shapes`` option, if given."""


def is_tensor_struct(t: DataType) -> bool:
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


def plan_column(name: str, t: DataType, options) -> ColumnPlan:
    shape = options.shapes.get(name)
    if is_tensor_struct(t):
        target = options.column_dtypes.get(name, options.dtype)
        return ColumnPlan(name, "struct", 0, "", target, shape)
    depth, leaf = 0, t
    while isinstance(leaf, ArrayType):
        depth, leaf = depth + 1, leaf.elementType
    source = NUMERIC.get(type(leaf))
    if source is None:
        raise ColumnError(
            f"column {name!r} has type {t.simpleString()}, which cannot be written as a tensor; accepted: {ACCEPTED}"
        )
    target = options.target_dtype(name, source.startswith("F"), source)
    return ColumnPlan(name, "array" if depth else "scalar", depth, source, target, shape)


# ---------------------------------------------------------------------------- decoding


def _fail(column: str, detail: str, row: int | None = None, key: str | None = None) -> None:
    where = (
        f" (key {key!r})"
        if key is not None
        else f" (row {row} of this partition)"
        if row is not None
        else ""
    )
    raise ColumnError(f"column {column!r}{where}: {detail}")


def _leaf_numpy(values: pa.Array, plan: ColumnPlan, first_row: int) -> np.ndarray:
    if values.null_count:
        _fail(plan.name, "null element inside an array; tensors cannot hold nulls", first_row)
    return values.to_numpy(zero_copy_only=False)


def _list_levels(arr: pa.Array, plan: ColumnPlan, first_row: int):
    """Walk nested lists: (offsets per level, relative to each level's child) and the leaf."""
    levels = []
    current = arr
    for level in range(plan.depth):
        if current.null_count:
            nulls = np.flatnonzero(~current.is_valid().to_numpy(zero_copy_only=False))
            _fail(
                plan.name,
                "null array" if level == 0 else "null inner array",
                first_row + int(nulls[0]) if level == 0 else first_row,
            )
        offsets = current.offsets.to_numpy()
        levels.append(offsets)
        current = current.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
        levels[-1] = offsets - offsets[0]
    return levels, _leaf_numpy(current, plan, first_row)


def decode_batch_column(arr: pa.Array, plan: ColumnPlan, first_row: int) -> np.ndarray:
    """A column chunk as one array ``[rows, *sample_shape]`` in the target dtype.

    Every row must have the same shape (batch mode); a ragged row is an error naming it.
    """
    rows = len(arr)
    if plan.kind == "struct":
        return _decode_struct_batch(arr, plan, first_row)
    if plan.kind == "scalar":
        if arr.null_count:
            _fail(plan.name, "null value", first_row + _first_null(arr))
        flat, sample = arr.to_numpy(zero_copy_only=False), ()
    else:
        levels, flat = _list_levels(arr, plan, first_row)
        sample = []
        for depth, offsets in enumerate(levels):
            lengths = np.diff(offsets)
            if lengths.size and (lengths != lengths[0]).any():
                bad = int(np.flatnonzero(lengths != lengths[0])[0])
                _fail(
                    plan.name,
                    f"ragged arrays: length {int(lengths[bad])} where {int(lengths[0])} was expected; every row must have the same shape in batch mode",
                    first_row + _row_of(levels, depth, bad),
                )
            sample.append(int(lengths[0]) if lengths.size else 0)
    out = cast_array(flat, plan.target, where=f"column {plan.name!r}")
    return _reshape(out, rows, tuple(sample), plan, first_row)


def _row_of(levels: list[np.ndarray], depth: int, position: int) -> int:
    """The row holding list ``position`` of nesting level ``depth``."""
    for offsets in reversed(levels[:depth]):
        position = int(np.searchsorted(offsets, position, side="right")) - 1
    return position


def _reshape(
    out: np.ndarray, rows: int, sample: tuple[int, ...], plan: ColumnPlan, first_row: int
) -> np.ndarray:
    if plan.shape is not None:
        want = math.prod(plan.shape)
        have = math.prod(sample)
        if rows and want != have:
            _fail(
                plan.name,
                f"{have} elements per row do not fit shapes={list(plan.shape)} ({want} elements)",
                first_row,
            )
        sample = plan.shape
    return out.reshape((rows, *sample))


def _first_null(arr: pa.Array) -> int:
    return int(np.flatnonzero(~arr.is_valid().to_numpy(zero_copy_only=False))[0])


def _struct_fields(arr: pa.StructArray, plan: ColumnPlan, first_row: int):
    if arr.null_count:
        _fail(plan.name, "null Tensor Struct", first_row + _first_null(arr))
    data, shape, dtype = (arr.field(n) for n in ("data", "shape", "dtype"))
    for name, child in (("data", data), ("shape", shape), ("dtype", dtype)):
        if child.null_count:
            _fail(plan.name, f"null {name} in a Tensor Struct", first_row + _first_null(child))
    return data, shape, dtype


def _decode_struct_batch(arr: pa.StructArray, plan: ColumnPlan, first_row: int) -> np.ndarray:
    rows = len(arr)
    data, shapes, dtypes = _struct_fields(arr, plan, first_row)
    if rows == 0:
        return np.empty((0, *(plan.shape or ())), dtype=get_dtype(plan.target or "F32").numpy)
    names = dtypes.unique().to_pylist()
    if len(names) != 1:
        _fail(
            plan.name,
            f"Tensor Structs of several dtypes {names} in one batch-mode column",
            first_row,
        )
    dtype = get_dtype(names[0], writable=True)
    shape_lists = shapes.to_pylist()
    if any(s != shape_lists[0] for s in shape_lists):
        bad = next(i for i, s in enumerate(shape_lists) if s != shape_lists[0])
        _fail(
            plan.name,
            f"Tensor Struct shape {shape_lists[bad]} differs from {shape_lists[0]}; every row must have the same shape in batch mode",
            first_row + bad,
        )
    sample = tuple(shape_lists[0])
    flat = _binary_values(data, dtype, sample, plan, first_row)
    out = cast_array(flat, plan.target, where=f"column {plan.name!r}") if plan.target else flat
    return _reshape(out, rows, sample, plan, first_row)


def _binary_values(data: pa.BinaryArray, dtype, sample, plan, first_row) -> np.ndarray:
    """The concatenated bytes of a binary column as one numpy array (zero-copy)."""
    offsets = np.frombuffer(data.buffers()[1], dtype=np.int32)[
        data.offset : data.offset + len(data) + 1
    ]
    need = math.prod(sample) * dtype.itemsize
    lengths = np.diff(offsets)
    if (lengths != need).any():
        bad = int(np.flatnonzero(lengths != need)[0])
        _fail(
            plan.name,
            f"Tensor Struct data has {int(lengths[bad])} bytes, shape {list(sample)} of {dtype} needs {need}",
            first_row + bad,
        )
    raw = (
        np.frombuffer(data.buffers()[2], dtype=np.uint8)[offsets[0] : offsets[-1]]
        if len(data) and need
        else np.empty(0, np.uint8)
    )
    return raw.view(dtype.numpy)


def decode_kv_column(arr: pa.Array, plan: ColumnPlan, keys: list[str]) -> list[np.ndarray]:
    """A column chunk as one tensor per row (shapes may differ between rows)."""
    if plan.kind == "struct":
        data, shapes, dtypes = _struct_fields(arr, plan, 0)
        out = []
        for i, (blob, shape, name) in enumerate(
            zip(data.to_pylist(), shapes.to_pylist(), dtypes.to_pylist(), strict=False)
        ):
            try:
                dtype = get_dtype(name, writable=True)
            except ValueError as e:
                _fail(plan.name, str(e), key=keys[i])
            if len(blob) != math.prod(shape) * dtype.itemsize:
                _fail(
                    plan.name,
                    f"data has {len(blob)} bytes, shape {shape} of {dtype} needs {math.prod(shape) * dtype.itemsize}",
                    key=keys[i],
                )
            t = np.frombuffer(blob, dtype=dtype.numpy).reshape(shape)
            out.append(
                cast_array(t, plan.target, where=f"column {plan.name!r}") if plan.target else t
            )
        return out
    if plan.kind == "scalar":
        if arr.null_count:
            _fail(plan.name, "null value", key=keys[_first_null(arr)])
        flat = cast_array(
            arr.to_numpy(zero_copy_only=False), plan.target, where=f"column {plan.name!r}"
        )
        return [flat[i].reshape(plan.shape or ()) for i in range(len(arr))]
    if arr.null_count:
        _fail(plan.name, "null array", key=keys[_first_null(arr)])
    if (
        plan.depth == 1 and plan.shape is None
    ):  # the common case, vectorised: views of one cast buffer
        levels, flat = _list_levels(arr, plan, 0)
        cast = cast_array(flat, plan.target, where=f"column {plan.name!r}")
        bounds = levels[0].tolist()
        return [cast[a:b] for a, b in itertools.pairwise(bounds)]
    out = []
    for i in range(len(arr)):
        row = arr[i : i + 1]
        try:
            levels, flat = _list_levels(row, plan, 0)
        except ColumnError as e:
            raise ColumnError(
                str(e).replace("(row 0 of this partition)", f"(key {keys[i]!r})")
            ) from None
        shape = []
        for offsets in levels:
            lengths = np.diff(offsets)
            if lengths.size and (lengths != lengths[0]).any():
                _fail(plan.name, "ragged nested arrays inside one row", key=keys[i])
            shape.append(int(lengths[0]) if lengths.size else 0)
        t = cast_array(flat, plan.target, where=f"column {plan.name!r} (key {keys[i]!r})")
        if plan.shape is not None:
            if math.prod(plan.shape) != math.prod(shape):
                _fail(
                    plan.name,
                    f"{math.prod(shape)} elements do not fit shapes={list(plan.shape)}",
                    key=keys[i],
                )
            shape = list(plan.shape)
        out.append(t.reshape(shape))
    return out
