"""One dtype vocabulary: aliases map to the canonical names; errors speak canonical names."""

import ml_dtypes
import numpy as np
import pytest
import torch

from pyspark_safetensors.format import (
    DTYPES,
    WRITABLE,
    CastError,
    DTypeNameError,
    canonical_dtype,
    cast_array,
    get_dtype,
)


@pytest.mark.parametrize(
    "names,canonical",
    [
        (["F16", "f16", "float16", "fp16", "half", "torch.float16", "np.float16", torch.float16, np.float16], "F16"),
        (["BF16", "bfloat16", "bf16", "torch.bfloat16", torch.bfloat16, ml_dtypes.bfloat16], "BF16"),
        (["F32", "float32", "float", "fp32", "torch.float", torch.float32, np.dtype("float32")], "F32"),
        (["F64", "float64", "double", "torch.double", torch.float64], "F64"),
        (["I64", "int64", "long", "bigint", torch.int64], "I64"),
        (["I32", "int32", "int", "integer", torch.int32], "I32"),
        (["I16", "int16", "short", "smallint"], "I16"),
        (["I8", "int8", "tinyint"], "I8"),
        (["U8", "uint8", torch.uint8], "U8"),
        (["BOOL", "bool", torch.bool], "BOOL"),
        (["F8_E4M3", "float8_e4m3fn", torch.float8_e4m3fn], "F8_E4M3"),
    ],
)  # fmt: skip
def test_aliases(names, canonical):
    for name in names:
        assert canonical_dtype(name) == canonical
        assert get_dtype(name) is DTYPES[canonical]


def test_every_canonical_name_is_its_own_alias():
    assert [canonical_dtype(n) for n in DTYPES] == list(DTYPES)
    assert [canonical_dtype(n, writable=True) for n in WRITABLE] == list(WRITABLE)


def test_errors_name_canonical_choices_and_the_closest():
    with pytest.raises(
        DTypeNameError, match=r"unknown dtype 'fp61'; valid dtypes: F16, .*; did you mean F64\?"
    ):
        canonical_dtype("fp61", writable=True)
    with pytest.raises(DTypeNameError, match=r"dtype BOOL .* can be read but not written"):
        canonical_dtype("bool", writable=True)
    with pytest.raises(ValueError, match="byte"):  # ambiguous: Spark's int8, torch's uint8
        canonical_dtype("byte")


def test_exact_casts_refuse_integers_a_float_cannot_hold():
    ok = np.array([0, 2048, -2048, 65504], dtype=np.int64)
    assert cast_array(ok, "F16", exact=True).tolist() == ok.tolist()
    assert cast_array(np.array([2**60], dtype=np.int64), "F32", exact=True).item() == 2.0**60
    for values, target in [([2049], "F16"), ([257], "BF16"), ([2**24 + 1], "F32"),
                           ([2**53 + 1], "F64"), ([2**63 - 1], "F32"), ([70000], "F16")]:  # fmt: skip
        with pytest.raises(CastError, match=f"value {values[0]} in col .* {target}"):
            cast_array(np.array(values, dtype=np.int64), target, where="col", exact=True)
        cast_array(np.array(values, dtype=np.int64), target)  # without exact: rounds like torch
