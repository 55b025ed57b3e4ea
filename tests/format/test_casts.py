"""Casts compared bit for bit with torch, and the C kernel against its numpy twin."""

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from pyspark_safetensors.format import CastError, cast_array, casts

SPECIAL_F32 = np.array(
    [
        0.0, -0.0, 1.0, -1.0, 65504.0, 65505.0, 65519.99, 65520.0, -65520.0, 1e10, -1e10,
        np.inf, -np.inf, np.nan, -np.nan,
        2.0**-14, 2.0**-24, 2.0**-25, 2.0**-25 * 1.0000001, 3 * 2.0**-25, 2.0**-26, 1e-45,
        1 + 2.0**-11, 1 + 3 * 2.0**-11, 1 + 2.0**-8, 1 + 3 * 2.0**-8,  # F16 / BF16 ties
        3.3895314e38, 3.4028235e38, -3.4028235e38, 1.1754944e-38, 9.2e-41,
    ],
    dtype=np.float32,
)  # fmt: skip
NAN_PAYLOADS = np.array(
    [0x7F800001, 0xFF812345, 0x7FFFFFFF, 0x7FC00000, 0xFFC00001], dtype=np.uint32
).view(np.float32)


def torch_bits(x: np.ndarray, dtype) -> np.ndarray:
    return torch.from_numpy(x).to(dtype).view(torch.int16).numpy().view(np.uint16)


def all_inputs():
    rng = np.random.default_rng(0)
    random_bits = (
        rng.integers(0, 2**32, size=200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    )
    normal = rng.standard_normal(100_000).astype(np.float32) * 1000
    return np.concatenate([SPECIAL_F32, NAN_PAYLOADS, random_bits, normal])


@pytest.mark.parametrize("name,tdtype", [("F16", torch.float16), ("BF16", torch.bfloat16)])
def test_half_casts_match_torch_bit_for_bit(name, tdtype):
    x = all_inputs()
    ours = cast_array(x, name).view(np.uint16)
    np.testing.assert_array_equal(ours, torch_bits(x, tdtype))


@pytest.mark.parametrize("name,tdtype", [("F16", torch.float16), ("BF16", torch.bfloat16)])
def test_f64_to_half_goes_through_f32_like_torch(name, tdtype):
    rng = np.random.default_rng(1)
    x = np.concatenate(
        [
            [1 + 2.0**-11 + 2.0**-40, 65519.999999, 2.0**-25 + 2.0**-60],
            rng.standard_normal(10_000) * 300,
        ]
    )
    np.testing.assert_array_equal(cast_array(x, name).view(np.uint16), torch_bits(x, tdtype))


def test_large_array_uses_threads_and_matches_reference():
    x = np.random.default_rng(2).standard_normal(3_000_001).astype(np.float32)
    np.testing.assert_array_equal(casts.to_f16(x).view(np.uint16), casts.reference_f16(x))
    np.testing.assert_array_equal(casts.to_bf16(x).view(np.uint16), casts.reference_bf16(x))


@settings(max_examples=200, deadline=None)
@given(hnp.arrays(np.uint32, st.integers(0, 300), elements=st.integers(0, 2**32 - 1)))
def test_kernel_equals_numpy_twin(bits):
    x = bits.view(np.float32)
    np.testing.assert_array_equal(casts.to_f16(x).view(np.uint16), casts.reference_f16(x))
    np.testing.assert_array_equal(casts.to_bf16(x).view(np.uint16), casts.reference_bf16(x))


def test_shapes_and_dtypes_of_results():
    x = np.ones((3, 4), dtype=np.float32)
    assert cast_array(x, "F16").dtype == np.float16 and cast_array(x, "F16").shape == (3, 4)
    assert cast_array(x, "BF16").dtype == ml_dtypes.bfloat16
    assert cast_array(x, "F32") is x
    assert cast_array(np.float64(2.5), "F16").shape == ()


@pytest.mark.parametrize("target", ["I8", "U8", "I16", "U16", "I32", "U32", "I64", "U64"])
def test_integer_casts_are_exact_and_refuse_overflow(target):
    info = np.iinfo(np.dtype(target.replace("I", "int").replace("U", "uint") + ""))
    ok = np.array([info.min, 0, info.max], dtype=np.int64 if info.max < 2**63 else np.uint64)
    if info.max >= 2**63:
        ok = np.array([0, 2**64 - 1], dtype=np.uint64)
    out = cast_array(ok, target)
    assert [int(v) for v in out] == [int(v) for v in ok]
    too_big = (
        np.array([int(info.max) + 1], dtype=np.uint64 if info.max >= 2**62 else np.int64)
        if info.max < 2**64 - 1
        else None
    )
    if too_big is not None:
        with pytest.raises(CastError, match=rf"{int(info.max) + 1}.*overflows {target}"):
            cast_array(too_big, target, where="column 'x'")
    if info.min < 0:
        if info.min > -(2**63):
            with pytest.raises(CastError, match="overflows"):
                cast_array(np.array([int(info.min) - 1], dtype=np.int64), target)
    else:
        with pytest.raises(CastError, match=r"-1.*overflows"):
            cast_array(np.array([-1], dtype=np.int64), target)


def test_int64_extremes_exact_without_float_detour():
    x = np.array([2**63 - 1, -(2**63), 2**53 + 1], dtype=np.int64)
    assert cast_array(x, "I64") is x
    assert [int(v) for v in cast_array(x[2:], "U64")] == [2**53 + 1]
    with pytest.raises(CastError, match="-9223372036854775808"):
        cast_array(x, "U64")


def test_float_to_integer_requires_integral_finite_values():
    assert cast_array(np.array([1.0, -3.0]), "I32").tolist() == [1, -3]
    with pytest.raises(CastError, match="not an integer"):
        cast_array(np.array([1.5]), "I32", where="column 'c'")
    with pytest.raises(CastError, match="not finite"):
        cast_array(np.array([np.nan]), "I64")
    with pytest.raises(CastError, match="overflows I8"):
        cast_array(np.array([128.0]), "I8")
    with pytest.raises(CastError, match="overflows I64"):
        cast_array(np.array([2.0**63]), "I64")


def test_f64_to_f32_as_numpy():
    x = np.random.default_rng(3).standard_normal(1000) * 1e30
    np.testing.assert_array_equal(cast_array(x, "F32"), x.astype(np.float32))
