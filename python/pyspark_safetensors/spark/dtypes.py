"""Spark's types beside the safetensors dtypes: what a Spark numeric type is written as,
what Spark type a stored dtype is read as, and the element types of ``st_to_array``.

Derived from the format layer's dtype table: a Spark numeric type is written as the dtype
its SQL name names (``float`` → F32, ``bigint`` → I64, ...), and a stored dtype is read
as the narrowest Spark type that holds every value of it (half floats widen to float,
unsigned integers to the next wider signed type; U64 to long, checked per value).
"""

from __future__ import annotations

import numpy as np
from pyspark.sql.types import (
    BooleanType,
    ByteType,
    DataType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    ShortType,
)

from ..format.dtypes import DTYPES, WRITABLE, canonical_dtype

SPARK_NUMERIC_TYPES: dict[str, DataType] = {
    "float": FloatType(), "double": DoubleType(), "int": IntegerType(), "long": LongType(),
    "short": ShortType(), "byte": ByteType(),
}  # fmt: skip
"""Spark's numeric types by their DDL names (the element types ``st_to_array`` takes)."""

WRITTEN_DTYPES: dict[type[DataType], str] = {
    type(t): canonical_dtype(t.simpleString()) for t in SPARK_NUMERIC_TYPES.values()
}
"""The dtype a Spark numeric type is written as by default (FloatType → F32, ...)."""

ELEMENT_DTYPES: dict[str, str] = {
    name: WRITTEN_DTYPES[type(t)] for name, t in SPARK_NUMERIC_TYPES.items()
}
"""Element types ``st_to_array`` returns, and the dtype each one holds."""

_BY_DTYPE = {dtype: t for t in SPARK_NUMERIC_TYPES.values() for dtype in [WRITTEN_DTYPES[type(t)]]}


def _read_type(name: str) -> DataType:
    dtype = DTYPES[name]
    if name == "BOOL":
        return BooleanType()
    if dtype.is_float:
        return _BY_DTYPE["F32" if dtype.bits <= 32 else "F64"]
    signed_bits = dtype.bits if name.startswith("I") else min(2 * dtype.bits, 64)
    return _BY_DTYPE[f"I{signed_bits}"]


def _numpy_of(t: DataType) -> np.dtype:
    if isinstance(t, BooleanType):
        return np.dtype(bool)
    return DTYPES[WRITTEN_DTYPES[type(t)]].numpy


READ_TYPES: dict[str, tuple[DataType, np.dtype]] = {
    name: (t, _numpy_of(t)) for name in (*WRITABLE, "BOOL") for t in [_read_type(name)]
}
"""Stored dtype → (the Spark type it is read as, the numpy dtype its values are
converted to)."""


def written_dtype(t: DataType) -> str | None:
    """The dtype a Spark numeric type is written as, or None for a non-numeric type."""
    return WRITTEN_DTYPES.get(type(t))


__all__ = ["ELEMENT_DTYPES", "READ_TYPES", "SPARK_NUMERIC_TYPES", "WRITTEN_DTYPES", "written_dtype"]
