"""Typed errors of the format layer: one class per rule, all of them ``ValueError``s.

Every message names the file (when known), the tensor (when there is one) and the rule
that was broken, so a user can find and fix the offending input.
"""

from __future__ import annotations


class SafetensorsFormatError(ValueError):
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


class CastError(ValueError):
    """A value cannot be represented exactly in the target dtype (integer overflow,
    a fraction or a non-finite value cast to an integer dtype)."""
