"""From Spark columns to tensors: type planning on the driver, zero-copy Arrow decoding in
the tasks.

Accepted column types: numeric arrays (``array<float|double|int|long|short|byte>``),
nested numeric arrays (``array<array<...>>``), numeric scalars (per-sample shape ``[]``)
and Tensor Structs ``struct<data: binary, shape: array<int>, dtype: string>``.
"""

from __future__ import annotations

import itertools
import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import numpy as np
import pyarrow as pa
from pyspark.sql.types import ArrayType, DataType

from ..format import CastError, PackedTensors, cast_array, get_dtype
from ..format.errors import PysparkSafetensorsError
from .dtypes import SPARK_NUMERIC_TYPES, written_dtype
from .tensor_struct import TENSOR_STRUCT_DDL, is_tensor_struct

ACCEPTED = (
    f"array<{'|'.join(SPARK_NUMERIC_TYPES)}> (nested arrays too), a numeric scalar, or a "
    f"Tensor Struct {TENSOR_STRUCT_DDL}"
)


class ColumnError(PysparkSafetensorsError, ValueError):
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
    cast_hint: str = ""
    """Added to cast errors: how to change the dtype this column gets."""


def plan_column(name: str, t: DataType, options) -> ColumnPlan:
    shape = options.shapes.get(name)
    hint = (
        f"; the dtype option {options.dtype} applies to every numeric column: give dtypes per "
        f'column as JSON instead, e.g. dtype={{"{name}": "..."}}'
        if options.dtype is not None and name not in options.column_dtypes
        else ""
    )
    if is_tensor_struct(t):
        target = options.column_dtypes.get(name, options.dtype)
        return ColumnPlan(name, "struct", 0, "", target, shape, hint)
    depth, leaf = 0, t
    while isinstance(leaf, ArrayType):
        depth, leaf = depth + 1, leaf.elementType
    source = written_dtype(leaf)
    if source is None:
        raise ColumnError(
            f"column {name!r} has type {t.simpleString()}, which cannot be written as a tensor; accepted: {ACCEPTED}"
        )
    target = options.target_dtype(name, source)
    return ColumnPlan(name, "array" if depth else "scalar", depth, source, target, shape, hint)


# ---------------------------------------------------------------------------- decoding
#
# Both modes decode a whole Arrow column chunk at once: the leaf values are one buffer,
# cast once, and per-row shapes come from the list offsets with numpy. Problems are
# raised as _BadRow (a row of the chunk) and reported naming the row (batch mode) or its
# key (KV mode).


class _BadRow(Exception):
    def __init__(self, detail: str, row: int):
        super().__init__(detail)
        self.detail, self.row = detail, row


def _fail(column: str, detail: str, row: int | None = None, key: str | None = None) -> None:
    where = (
        f" (key {key!r})"
        if key is not None
        else f" (row {row} of this partition)"
        if row is not None
        else ""
    )
    raise ColumnError(f"column {column!r}{where}: {detail}")


@contextmanager
def _naming_rows(plan: ColumnPlan, first_row: int = 0, keys: list[str] | None = None):
    try:
        yield
    except _BadRow as e:
        if keys is not None:
            _fail(plan.name, e.detail, key=keys[e.row])
        _fail(plan.name, e.detail, first_row + e.row)


def first_null(arr: pa.Array) -> int:
    """The position of the first null of an Arrow array that has one."""
    return int(np.flatnonzero(~arr.is_valid().to_numpy(zero_copy_only=False))[0])


def _no_nulls(arr: pa.Array, what: str, row_of=lambda i: i) -> None:
    if arr.null_count:
        raise _BadRow(what, row_of(first_null(arr)))


def _row_of(levels: list[np.ndarray], depth: int, position: int) -> int:
    """The row holding item ``position`` of nesting level ``depth``."""
    for offsets in reversed(levels[:depth]):
        position = int(np.searchsorted(offsets, position, side="right")) - 1
    return position


def _array_rows(arr: pa.Array, plan: ColumnPlan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A numeric (nested) array or scalar column as (leaf values, element bounds of each
    row ``[rows + 1]``, dims of each row ``[rows, depth]``). Each row must be rectangular;
    rows may differ from each other."""
    rows = len(arr)
    if plan.kind == "scalar":
        _no_nulls(arr, "null value")
        return (
            arr.to_numpy(zero_copy_only=False),
            np.arange(rows + 1, dtype=np.int64),
            np.zeros((rows, 0), dtype=np.int64),
        )
    levels: list[np.ndarray] = []  # offsets per level, relative to each level's child
    current = arr
    for level in range(plan.depth):
        _no_nulls(
            current,
            "null array" if level == 0 else "null inner array",
            lambda i, level=level: _row_of(levels, level, i),
        )
        offsets = current.offsets.to_numpy()
        current = current.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
        levels.append((offsets - offsets[0]).astype(np.int64))
    _no_nulls(
        current,
        "null element inside an array; tensors cannot hold nulls",
        lambda i: _row_of(levels, plan.depth, i),
    )
    flat = current.to_numpy(zero_copy_only=False)

    dims = np.zeros((rows, plan.depth), dtype=np.int64)
    every_row = np.arange(rows)
    owner = every_row  # the row of each list at the current level
    for level, offsets in enumerate(levels):
        lengths = np.diff(offsets)
        if not len(lengths):
            break
        first = np.minimum(np.searchsorted(owner, every_row), len(owner) - 1)
        has = owner[first] == every_row  # rows with at least one list at this level
        dims[has, level] = lengths[first[has]]
        ragged = lengths != dims[owner, level]
        if ragged.any():
            bad = int(owner[np.argmax(ragged)])
            raise _BadRow(
                f"ragged arrays inside one row: inner lengths {sorted(set(lengths[owner == bad].tolist()))}",
                bad,
            )
        if level + 1 < len(levels):
            owner = np.repeat(owner, lengths)
    bounds = np.arange(rows + 1, dtype=np.int64)
    for offsets in levels:
        bounds = offsets[bounds]
    return flat, bounds, dims


def _cast(flat: np.ndarray, plan: ColumnPlan, bounds: np.ndarray) -> np.ndarray:
    """``flat`` in the plan's target dtype; a failing cast names the first bad row."""
    try:
        return cast_array(flat, plan.target, where=f"column {plan.name!r}", exact=True)
    except CastError:
        for row, (a, b) in enumerate(itertools.pairwise(bounds.tolist())):
            try:
                cast_array(flat[a:b], plan.target, exact=True)
            except CastError as e:
                raise _BadRow(f"{e}{plan.cast_hint}", row) from None
        raise


def _checked_shape(plan: ColumnPlan, sample: tuple[int, ...], row: int) -> tuple[int, ...]:
    """The sample shape to write: the data's, or the ``shapes`` option's when it fits."""
    if plan.shape is None:
        return sample
    if math.prod(plan.shape) != math.prod(sample):
        raise _BadRow(
            f"{math.prod(sample)} elements per row do not fit shapes={list(plan.shape)} "
            f"({math.prod(plan.shape)} elements)",
            row,
        )
    return plan.shape


def _fit_shapes(plan: ColumnPlan, specs: tuple, spec_of: np.ndarray) -> tuple:
    """KV specs with the ``shapes`` option applied; a spec that does not fit names the
    first row using it."""
    if plan.shape is None:
        return specs
    return tuple(
        (dtype, _checked_shape(plan, shape, int(np.argmax(spec_of == i))))
        for i, (dtype, shape) in enumerate(specs)
    )


def decode_batch_column(arr: pa.Array, plan: ColumnPlan, first_row: int) -> np.ndarray:
    """A column chunk as one array ``[rows, *sample_shape]`` in the target dtype.

    Every row must have the same shape (batch mode); a ragged row is an error naming it.
    """
    rows = len(arr)
    with _naming_rows(plan, first_row):
        if plan.kind == "struct":
            data, _, specs, spec_of = _struct_rows(arr, plan)
            if rows == 0:
                target = get_dtype(plan.target or "F32")
                return np.empty((0, *(plan.shape or ())), dtype=target.numpy)
            if len(specs) > 1:
                (d0, s0), bad = specs[spec_of[0]], int(np.argmax(spec_of != spec_of[0]))
                d1, s1 = specs[spec_of[bad]]
                raise _BadRow(
                    f"Tensor Struct of {d1} {list(s1)} where {d0} {list(s0)} was expected; "
                    "every row must have the same dtype and shape in batch mode",
                    bad,
                )
            (dtype, sample) = specs[0]
            flat = data.view(dtype.numpy) if len(data) else np.empty(0, dtype.numpy)
            bounds = np.arange(rows + 1, dtype=np.int64) * math.prod(sample)
            out = _cast(flat, plan, bounds) if plan.target else flat
        else:
            flat, bounds, dims = _array_rows(arr, plan)
            if rows and (dims != dims[0]).any():
                bad = int(np.argmax((dims != dims[0]).any(axis=1)))
                raise _BadRow(
                    f"ragged arrays: shape {dims[bad].tolist()} where {dims[0].tolist()} was "
                    "expected; every row must have the same shape in batch mode",
                    bad,
                )
            sample = tuple(dims[0].tolist()) if rows else (0,) * plan.depth
            out = _cast(flat, plan, bounds)
        return out.reshape((rows, *_checked_shape(plan, sample, 0)))


def decode_kv_column(arr: pa.Array, plan: ColumnPlan, keys: list[str]) -> PackedTensors:
    """A column chunk as one tensor per row (shapes may differ between rows), packed."""
    with _naming_rows(plan, keys=keys):
        if plan.kind == "struct":
            return _cast_struct_rows(*_struct_rows(arr, plan), plan)
        flat, bounds, dims = _array_rows(arr, plan)
        out = _cast(flat, plan, bounds)
        dtype = get_dtype(plan.target)
        if not len(dims) or (dims == dims[0]).all():
            shapes, spec_of = dims[:1], np.zeros(len(dims), dtype=np.int64)
        else:
            shapes, spec_of = np.unique(dims, axis=0, return_inverse=True)
        spec_of = spec_of.reshape(-1).astype(np.int64)
        specs = _fit_shapes(plan, tuple((dtype, tuple(s)) for s in shapes.tolist()), spec_of)
        return PackedTensors(_bytes(out), bounds[:-1] * dtype.itemsize, specs, spec_of)


def _bytes(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x).reshape(-1).view(np.uint8)


# ------------------------------------------------------------------- Tensor Structs


def _struct_rows(arr: pa.StructArray, plan: ColumnPlan):
    """A Tensor Struct column as (bytes, byte start of each row, distinct (dtype, shape)
    specs, spec of each row), checked: known dtypes, byte counts matching shapes."""
    _no_nulls(arr, "null Tensor Struct")
    data, shapes, dtypes = (arr.field(n) for n in ("data", "shape", "dtype"))
    for name, child in (("data", data), ("shape", shapes), ("dtype", dtypes)):
        _no_nulls(child, f"null {name} in a Tensor Struct")
    rows = len(arr)
    if rows == 0:
        return np.empty(0, np.uint8), np.empty(0, np.int64), (), np.empty(0, np.int64)
    encoded = dtypes.dictionary_encode()
    codes = encoded.indices.to_numpy(zero_copy_only=False).astype(np.int64)
    known = []
    for code, name in enumerate(encoded.dictionary.to_pylist()):
        try:
            known.append(get_dtype(name, writable=True))
        except ValueError as e:
            raise _BadRow(str(e), int(np.argmax(codes == code))) from None

    offsets = shapes.offsets.to_numpy()
    ranks = np.diff(offsets)
    flat_dims = shapes.flatten()

    def row_of_dim(i: int) -> int:
        return int(np.searchsorted(offsets - offsets[0], i, side="right")) - 1

    _no_nulls(flat_dims, "null dimension in a Tensor Struct shape", row_of_dim)
    dims = flat_dims.to_numpy(zero_copy_only=False).astype(np.int64)
    if (dims < 0).any():
        raise _BadRow(
            "negative dimension in a Tensor Struct shape", row_of_dim(np.argmax(dims < 0))
        )
    if (ranks == ranks[0]).all():
        keyed = np.column_stack([codes, dims.reshape(rows, int(ranks[0]))])
        unique, spec_of = np.unique(keyed, axis=0, return_inverse=True)
        specs = tuple((known[u[0]], tuple(u[1:])) for u in unique.tolist())
    else:  # rows of several ranks: one small tuple per row
        ids: dict = {}
        per_row = zip(codes.tolist(), shapes.to_pylist(), strict=True)
        spec_of = np.array([ids.setdefault((c, tuple(s)), len(ids)) for c, s in per_row])
        specs = tuple((known[c], s) for c, s in ids)
    spec_of = spec_of.reshape(-1).astype(np.int64)

    bounds = np.frombuffer(data.buffers()[1], dtype=np.int32)[data.offset : data.offset + rows + 1]
    need = np.array([d.nbytes(math.prod(s)) for d, s in specs] or [0], dtype=np.int64)[spec_of]
    wrong = np.diff(bounds) != need
    if wrong.any():
        bad = int(np.argmax(wrong))
        dtype, shape = specs[spec_of[bad]]
        raise _BadRow(
            f"Tensor Struct data has {int(np.diff(bounds)[bad])} bytes, shape {list(shape)} "
            f"of {dtype} needs {int(need[bad])}",
            bad,
        )
    raw = (
        np.frombuffer(data.buffers()[2], dtype=np.uint8)[bounds[0] : bounds[-1]]
        if rows and bounds[-1] > bounds[0]
        else np.empty(0, np.uint8)
    )
    return raw, (bounds[:-1] - bounds[0]).astype(np.int64), specs, spec_of


def _cast_struct_rows(raw, starts, specs, spec_of, plan: ColumnPlan) -> PackedTensors:
    """Tensor Struct rows in the plan's target dtype (their own dtypes when it has none)."""
    target = get_dtype(plan.target) if plan.target else None
    specs = _fit_shapes(plan, specs, spec_of)
    if target is None or all(dtype == target for dtype, _ in specs):
        return PackedTensors(raw, starts, specs, spec_of)
    sources = {dtype for dtype, _ in specs}
    if len(sources) == 1:  # one cast over the whole buffer
        (source,) = sources
        flat = raw.view(source.numpy)
        bounds = np.append(starts, len(raw)) // source.itemsize
        out = _cast(flat, plan, bounds)
        return PackedTensors(
            _bytes(out),
            starts // source.itemsize * target.itemsize,
            tuple((target, shape) for _, shape in specs),
            spec_of,
        )
    # Several source dtypes in one chunk: cast row by row.
    ends = np.append(starts[1:], len(raw))
    arrays = []
    rows = zip(starts.tolist(), ends.tolist(), spec_of.tolist(), strict=True)
    for row, (a, b, s) in enumerate(rows):
        dtype, shape = specs[s]
        try:
            arrays.append(cast_array(raw[a:b].view(dtype.numpy), target, exact=True).reshape(shape))
        except CastError as e:
            raise _BadRow(f"{e}{plan.cast_hint}", row) from None
    return PackedTensors.of(arrays)
