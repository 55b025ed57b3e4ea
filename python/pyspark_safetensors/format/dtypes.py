"""The safetensors dtype table: names, sizes, alignment order and numpy mapping.

Reading accepts every dtype of the reference library (0.8); writing accepts the twelve of
the dataset format spec (``WRITABLE``). Types without a numpy dtype (the 4- and 6-bit
floats) are readable as raw bytes only.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from .errors import InvalidTypeError, PysparkSafetensorsError


@dataclass(frozen=True)
class DType:
    """One safetensors dtype."""

    name: str
    """The header string, e.g. ``"BF16"``."""
    bits: int
    """Bits per element (4 and 6 for the packed sub-byte floats)."""
    rank: int
    """Position in the reference library's dtype enum. Writers order tensors by rank,
    largest first, then by name, so every tensor stays aligned."""
    numpy: np.dtype | None
    """The numpy dtype holding this type's bytes, or None (sub-byte floats)."""

    @property
    def itemsize(self) -> int:
        """Bytes per element; raises for the packed sub-byte floats."""
        if self.bits % 8:
            raise ValueError(
                f"dtype {self.name} packs {self.bits}-bit elements; it has no itemsize"
            )
        return self.bits // 8

    def nbytes(self, numel: int) -> int | None:
        """Bytes taken by ``numel`` elements, or None when they do not end on a byte."""
        total_bits = numel * self.bits
        return total_bits // 8 if total_bits % 8 == 0 else None

    @property
    def is_float(self) -> bool:
        return self.name.startswith(("F", "BF", "C"))

    @property
    def is_integer(self) -> bool:
        return self.name[0] in "IU"

    def __str__(self) -> str:
        return self.name


def _np(name: str | None) -> np.dtype | None:
    if name is None:
        return None
    return np.dtype(getattr(ml_dtypes, name, None) or name).newbyteorder("<")


# (name, bits, numpy dtype) in the reference library's enum order (its sort key).
_TABLE = [
    ("BOOL", 8, "bool"),
    ("F4", 4, None),
    ("F6_E2M3", 6, None),
    ("F6_E3M2", 6, None),
    ("U8", 8, "uint8"),
    ("I8", 8, "int8"),
    ("F8_E5M2", 8, "float8_e5m2"),
    ("F8_E4M3", 8, "float8_e4m3fn"),
    ("F8_E8M0", 8, "float8_e8m0fnu"),
    ("F8_E4M3FNUZ", 8, "float8_e4m3fnuz"),
    ("F8_E5M2FNUZ", 8, "float8_e5m2fnuz"),
    ("I16", 16, "int16"),
    ("U16", 16, "uint16"),
    ("F16", 16, "float16"),
    ("BF16", 16, "bfloat16"),
    ("I32", 32, "int32"),
    ("U32", 32, "uint32"),
    ("F32", 32, "float32"),
    ("C64", 64, "complex64"),
    ("F64", 64, "float64"),
    ("I64", 64, "int64"),
    ("U64", 64, "uint64"),
]

DTYPES: dict[str, DType] = {
    name: DType(name, bits, rank, _np(np_name)) for rank, (name, bits, np_name) in enumerate(_TABLE)
}
"""Every readable dtype by header name."""

WRITABLE: tuple[str, ...] = (
    "F16", "F32", "F64", "BF16", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64",
)  # fmt: skip
"""The twelve dtypes of the dataset format spec (§1.3) that writers produce."""

_BY_NUMPY = {d.numpy: d for d in DTYPES.values() if d.numpy is not None}

# Other names users give a dtype, lower case: numpy/torch/ml_dtypes names, torch's short
# names, Spark SQL's type names and the usual shorthands. A "torch." or "np."/"numpy."
# prefix is ignored. "byte" is left out on purpose: Spark's ByteType is I8, torch's
# .byte() is U8.
_ALIASES = {
    "BOOL": ("bool", "boolean"),
    "U8": ("uint8",),
    "I8": ("int8", "tinyint"),
    "I16": ("int16", "short", "smallint"),
    "U16": ("uint16",),
    "I32": ("int32", "int", "integer"),
    "U32": ("uint32",),
    "I64": ("int64", "long", "bigint"),
    "U64": ("uint64",),
    "F16": ("float16", "fp16", "half"),
    "BF16": ("bfloat16", "bf16"),
    "F32": ("float32", "fp32", "float", "single"),
    "F64": ("float64", "fp64", "double"),
    "C64": ("complex64", "cfloat"),
    "F8_E5M2": ("float8_e5m2",),
    "F8_E4M3": ("float8_e4m3fn", "float8_e4m3"),
    "F8_E8M0": ("float8_e8m0fnu", "float8_e8m0"),
    "F8_E4M3FNUZ": ("float8_e4m3fnuz",),
    "F8_E5M2FNUZ": ("float8_e5m2fnuz",),
}
_NAMES = {name.lower(): name for name in DTYPES} | {
    alias: name for name, aliases in _ALIASES.items() for alias in aliases
}
_PREFIXES = ("torch.", "numpy.", "np.")


class DTypeNameError(PysparkSafetensorsError, ValueError):
    """A dtype name that names no safetensors dtype (or none that can be written)."""

    def __init__(self, message: str, *, read_only: str | None = None, closest: str | None = None):
        super().__init__(message)
        self.read_only = read_only
        """The canonical name, when the name was one of a dtype that cannot be written."""
        self.closest = closest
        """The closest valid canonical name, when there is one."""


ALIAS_EXAMPLES = "float16, fp16, half, bfloat16, float32, float, int64, long, torch.float16, ..."


def canonical_dtype(name: object, *, writable: bool = False) -> str:
    """The safetensors name (``"F16"``, ``"BF16"``, ...) of a dtype named any usual way:
    ``F16``, ``float16``, ``fp16``, ``half``, ``torch.float16``, ``np.float16`` (any
    case), a numpy dtype or a torch dtype. ``writable`` refuses the dtypes writers do not
    produce. Errors give the canonical names, and the closest one."""
    if isinstance(name, str):
        text = name
    else:
        try:  # numpy dtypes and scalar types (ml_dtypes' too); torch dtypes print as torch.x
            text = np.dtype(name).name  # type: ignore[arg-type]
        except TypeError:
            text = str(name)
    key = text.strip().lower()
    for prefix in _PREFIXES:
        if key.startswith(prefix):
            key = key[len(prefix) :]
            break
    canonical = _NAMES.get(key)
    choices = WRITABLE if writable else tuple(DTYPES)
    if canonical in choices:
        return canonical
    if canonical is not None:
        raise DTypeNameError(
            f"dtype {canonical} (from {text!r}) can be read but not written; "
            f"valid dtypes: {', '.join(choices)}",
            read_only=canonical,
        )
    close = [
        _NAMES[c]
        for c in difflib.get_close_matches(key, list(_NAMES), n=3, cutoff=0.6)
        if _NAMES[c] in choices
    ]
    hint = f"; did you mean {close[0]}?" if close else ""
    raise DTypeNameError(
        f"unknown dtype {text!r}; valid dtypes: {', '.join(choices)} (or their usual names: "
        f"{ALIAS_EXAMPLES}){hint}",
        closest=close[0] if close else None,
    )


def get_dtype(name: object, *, writable: bool = False) -> DType:
    """The ``DType`` of a dtype named any way ``canonical_dtype`` accepts."""
    return DTYPES[canonical_dtype(name, writable=writable)]


def dtype_of(array: np.ndarray) -> DType:
    """The safetensors dtype whose bytes a numpy array holds."""
    d = _BY_NUMPY.get(array.dtype) or _BY_NUMPY.get(array.dtype.newbyteorder("<"))
    if d is None:
        raise InvalidTypeError(f"numpy dtype {array.dtype} has no safetensors equivalent")
    return d
