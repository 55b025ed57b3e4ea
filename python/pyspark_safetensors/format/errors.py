"""Typed errors of the format layer: one class per rule, all of them ``ValueError``s, and
the package's error base.

``PysparkSafetensorsError`` is the base of every error the package raises for its users
(re-exported as ``pyspark_safetensors.PysparkSafetensorsError``). It lives here, in the
lowest layer, because every layer may import ``format`` and ``format`` imports nothing of
the package: a base anywhere higher would make ``format`` import upward.

Every message names the file (when known), the tensor (when there is one) and the rule
that was broken, so a user can find and fix the offending input.
"""

from __future__ import annotations


class PysparkSafetensorsError(Exception):
    """Something the user gave (a file, a dataset, an option, a config value) breaks a rule
    of the package; the message says which and how to fix it. The command line prints it
    as one line and exits with code 2. Each error also derives from the built-in it
    replaced (``ValueError``, ``TypeError``, ``OSError``, ...), so ``except ValueError``
    keeps working."""


USER_ERRORS = (
    PysparkSafetensorsError,
    FileNotFoundError,
    NotADirectoryError,
    IsADirectoryError,
    PermissionError,
    FileExistsError,
)
"""Exceptions that mean the input was wrong: the package's own errors, and a path that is
missing, of the wrong kind or not permitted. Entry points (the CLI, the trainer's ranks)
show them as one line; anything else (a bare ``ValueError`` included) is a bug and keeps
its traceback."""


class InvalidArgumentError(PysparkSafetensorsError, ValueError):
    """A value outside what a function or a config accepts (a size, a name, a choice)."""


class InvalidTypeError(PysparkSafetensorsError, TypeError):
    """A value of a type an operation cannot take (a dtype with no cast to the target)."""


class SafetensorsFormatError(PysparkSafetensorsError, ValueError):
    """A safetensors file or header breaks a rule of the format."""

    rule = "safetensors format"

    def __init__(self, detail: str, *, path: str | None = None, tensor: str | None = None):
        self.path = path
        self.tensor = tensor
        self.detail = detail
        where = []
        if path is not None:
            where.append(f"file {path!r}")
        if tensor is not None:
            where.append(f"tensor {tensor!r}")
        prefix = ", ".join(where)
        super().__init__(f"{prefix + ': ' if prefix else ''}{detail} [rule: {self.rule}]")


class NotRegularFileError(SafetensorsFormatError):
    rule = "a safetensors file is a regular file (not a directory, FIFO, socket or device)"


class TruncatedFileError(SafetensorsFormatError):
    rule = "file holds the 8-byte header length, the header and every tensor's bytes"


class HeaderTooLargeError(SafetensorsFormatError):
    rule = "header length N <= 100,000,000 bytes"


class NotSafetensorsError(HeaderTooLargeError):
    """The first 8 bytes cannot be a header length: over the limit and past the end of the
    file, as in a text file or another format."""

    rule = (
        "a safetensors file starts with its header length N (8 bytes, little-endian), "
        "N <= 100,000,000 and 8 + N <= file size"
    )


class HeaderEncodingError(SafetensorsFormatError):
    rule = (
        "header is UTF-8 JSON starting with '{': no NaN/Infinity, numbers within float64, "
        "no lone UTF-16 surrogates, nesting at most 127 deep"
    )


class HeaderStructureError(SafetensorsFormatError):
    rule = "header is a JSON object of tensor entries {dtype, shape, data_offsets}"


class DuplicateKeyError(SafetensorsFormatError):
    rule = "no duplicate keys in the header"


class MetadataError(SafetensorsFormatError):
    rule = "__metadata__ is an object of string keys to string values"


class UnknownDTypeError(SafetensorsFormatError):
    rule = "dtype is one of the known safetensors dtypes"


class ShapeError(SafetensorsFormatError):
    rule = "shape is a list of integers in 0..2^64-1 whose running product fits 64 bits"


class OffsetsError(SafetensorsFormatError):
    rule = "data_offsets are [begin, end] in 0..2^64-1, contiguous from 0 with no holes or overlaps"


class SizeMismatchError(SafetensorsFormatError):
    rule = "product(shape) x itemsize == end - begin"


class FileSizeError(SafetensorsFormatError):
    rule = "8 + N + last end == file size"


class CastError(PysparkSafetensorsError, ValueError):
    """A value cannot be represented exactly in the target dtype (integer overflow,
    a fraction or a non-finite value cast to an integer dtype)."""
