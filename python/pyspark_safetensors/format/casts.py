"""Casts into a safetensors dtype: round-to-nearest-even floats, exact integers.

- F32/F64 -> F16 and BF16 round to nearest even, bit-identical to torch on CPU (F64 goes
  through F32 first, as torch does). A C kernel (``_fastcast``, F16C on x86) does the
  float32 work on all cores; ``reference_f16``/``reference_bf16`` are its pure-numpy twins.
- F64 -> F32 and integer -> float as numpy does (round to nearest even).
- Integer targets are exact: an out-of-range value, a fraction, NaN or infinity raises a
  ``CastError`` naming the value and the target dtype. No trip through float64.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor

import ml_dtypes
import numpy as np

from .dtypes import DType, get_dtype
from .errors import CastError, InvalidArgumentError, InvalidTypeError

try:  # the compiled kernel is optional: without it the numpy twins do the work
    from . import _fastcast
except ImportError:  # pragma: no cover - exercised only where no compiler was available
    _fastcast = None

F16 = np.dtype(np.float16)
BF16 = np.dtype(ml_dtypes.bfloat16)

_PARALLEL_MIN = 1 << 20  # elements; below this one thread is faster than a pool hand-off
_pool: ThreadPoolExecutor | None = None


def _threads() -> int:
    return max(1, min(os.cpu_count() or 1, 8))


def _run_chunks(fn, src: np.ndarray, dst: np.ndarray) -> None:
    n = src.size
    workers = _threads()
    if n < _PARALLEL_MIN or workers == 1:
        fn(src, dst)
        return
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(workers, thread_name_prefix="pyspark-safetensors-cast")
    step = -(-n // workers)
    futures = [_pool.submit(fn, src[i : i + step], dst[i : i + step]) for i in range(0, n, step)]
    for f in futures:
        f.result()


# ---------------------------------------------------------------- float16 / bfloat16


def reference_f16(x32: np.ndarray) -> np.ndarray:
    """float32 -> float16 bits (uint16) in pure numpy; the twin of the C kernel."""
    with np.errstate(over="ignore", invalid="ignore"):
        bits = x32.astype(np.float16).view(np.uint16)
    u = x32.view(np.uint32)
    nan = np.isnan(x32)
    if nan.any():  # the F16C rule: sign, quiet bit, top payload bits
        un = u[nan]
        bits[nan] = (((un >> 16) & 0x8000) | 0x7E00 | ((un >> 13) & 0x3FF)).astype(np.uint16)
    return bits


def reference_bf16(x32: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16) in pure numpy; the twin of the C kernel."""
    u = x32.view(np.uint32)
    bits = ((u + (0x7FFF + ((u >> 16) & 1))) >> 16).astype(np.uint16)
    bits[np.isnan(x32)] = 0xFFFF
    return bits


def _half_bits(x: np.ndarray, kernel_name: str, reference) -> np.ndarray:
    x32 = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)  # F64 -> F32 first, like torch
    if _fastcast is None:
        return reference(x32)
    out = np.empty(x32.size, dtype=np.uint16)
    kernel = getattr(_fastcast, kernel_name)
    _run_chunks(lambda s, d: kernel(s, d), x32, out)
    return out


def to_f16(x: np.ndarray) -> np.ndarray:
    """Round floats to float16 (nearest even); returns a float16 array of x's shape."""
    return _half_bits(x, "f32_to_f16", reference_f16).view(F16).reshape(np.shape(x))


def to_bf16(x: np.ndarray) -> np.ndarray:
    """Round floats to bfloat16 (nearest even); returns an ml_dtypes.bfloat16 array."""
    return _half_bits(x, "f32_to_bf16", reference_bf16).view(BF16).reshape(np.shape(x))


# ---------------------------------------------------------------- dispatch


def _describe(where: str) -> str:
    return f" in {where}" if where else ""


def _check_integer_range(x: np.ndarray, target: np.dtype, dtype: DType, where: str) -> None:
    if x.size == 0:
        return
    info = np.iinfo(target)
    lo, hi = x.min(), x.max()
    # Compare in Python ints: exact for every integer width, no float64 detour.
    bad = lo if int(lo) < info.min else hi if int(hi) > info.max else None
    if bad is not None:
        raise CastError(
            f"value {int(bad)}{_describe(where)} overflows {dtype} (range {info.min}..{info.max})"
        )


def _check_integers_kept(x: np.ndarray, out: np.ndarray, dtype: DType, where: str) -> None:
    """Every integer of ``x`` is unchanged in the float array ``out``."""
    back = out.astype(np.float64)  # exact for every float target
    with np.errstate(invalid="ignore"):
        kept = back == x.astype(np.float64)
    large = np.abs(x.astype(np.float64)) >= 2.0**53  # beyond 2^53 float64 rounds: compare ints
    if large.any():
        kept[large] = [
            math.isfinite(b) and int(b) == int(v)
            for b, v in zip(back[large].tolist(), x[large].tolist(), strict=True)
        ]
    if not kept.all():
        i = int(np.argmin(kept.reshape(-1)))
        raise CastError(
            f"value {int(x.reshape(-1)[i])}{_describe(where)} is not exactly representable in "
            f"{dtype} (it would become {back.reshape(-1)[i].item()!r})"
        )


def cast_array(
    x: np.ndarray, dtype: DType | str, *, where: str = "", exact: bool = False
) -> np.ndarray:
    """Cast ``x`` to the numpy dtype that holds ``dtype``'s bytes, with the rules above.

    ``where`` (e.g. ``"column 'activation'"``) is named in error messages. ``exact``
    also refuses integers that a float target cannot hold exactly (e.g. 2049 in F16),
    so no cast changes an integer value. Returns ``x`` itself when it already has the
    target dtype.
    """
    if isinstance(dtype, str):
        dtype = get_dtype(dtype)
    x = np.asarray(x)
    out = _cast(x, dtype, where)
    if exact and x.dtype.kind in "iu" and dtype.is_float and x.size:
        _check_integers_kept(x, out, dtype, where)
    return out


def _cast(x: np.ndarray, dtype: DType | str, where: str) -> np.ndarray:
    if isinstance(dtype, str):
        dtype = get_dtype(dtype)
    target = dtype.numpy
    if target is None:
        raise InvalidArgumentError(f"cannot cast to {dtype}: it has no numpy representation")
    x = np.asarray(x)
    src = x.dtype
    if src == target:
        return x
    if dtype.name in ("F16", "BF16"):
        if src.kind == "f" and src.itemsize >= 4:
            return to_f16(x) if dtype.name == "F16" else to_bf16(x)
        if src.kind in "iub":  # exact in float32 up to 2^24; beyond, round once more like torch
            return _cast(x.astype(np.float32), dtype, where)
        if src in (F16, BF16):
            return _cast(x.astype(np.float32), dtype, where)
        raise InvalidTypeError(f"cannot cast {src}{_describe(where)} to {dtype}")
    if dtype.is_integer:
        if src.kind == "b":
            return x.astype(target)
        if src.kind in "iu":
            _check_integer_range(x, target, dtype, where)
            return x.astype(target)
        if src.kind == "f" or src in (F16, BF16):
            xf = x.astype(np.float64) if src.itemsize < 4 or src == BF16 else x
            finite = np.isfinite(xf)
            if not finite.all():
                raise CastError(
                    f"value {xf[~finite].flat[0]}{_describe(where)} is not finite; {dtype} holds integers only"
                )
            frac = xf != np.trunc(xf)
            if frac.any():
                raise CastError(
                    f"value {xf[frac].flat[0].item()!r}{_describe(where)} is not an integer; {dtype} holds integers only"
                )
            info = np.iinfo(target)
            # float bounds: info.max may not be representable, so test against 2^bits.
            if xf.size and (xf.min() < info.min or xf.max() >= float(info.max) + 1):
                bad = xf.min() if xf.min() < info.min else xf.max()
                raise CastError(
                    f"value {bad.item()!r}{_describe(where)} overflows {dtype} (range {info.min}..{info.max})"
                )
            return xf.astype(target)
        raise InvalidTypeError(f"cannot cast {src}{_describe(where)} to {dtype}")
    if dtype.is_float:
        if src.kind in "fiub" or src in (F16, BF16):
            return x.astype(target)
        raise InvalidTypeError(f"cannot cast {src}{_describe(where)} to {dtype}")
    if dtype.name == "BOOL":
        return x.astype(bool)
    raise InvalidTypeError(f"cannot cast {src}{_describe(where)} to {dtype}")
