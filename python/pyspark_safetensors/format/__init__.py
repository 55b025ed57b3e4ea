"""The safetensors format core: dtypes, headers, casts, shard writing and reading.

numpy only: no Spark, no torch. Everything above this layer builds on these verbs.
"""

from .casts import cast_array, to_bf16, to_f16
from .dtypes import DTYPES, WRITABLE, DType, dtype_of, get_dtype
from .errors import (
    CastError,
    DuplicateKeyError,
    FileSizeError,
    HeaderEncodingError,
    HeaderStructureError,
    HeaderTooLargeError,
    MetadataError,
    OffsetsError,
    SafetensorsFormatError,
    ShapeError,
    SizeMismatchError,
    TruncatedFileError,
    UnknownDTypeError,
)
from .header import MAX_HEADER_BYTES, Header, TensorInfo, decode_header, encode_header, layout_order
from .shard import ChunkedTensor, SafetensorsFile, read_header, write_shard

__all__ = [
    "DTYPES",
    "MAX_HEADER_BYTES",
    "WRITABLE",
    "CastError",
    "ChunkedTensor",
    "DType",
    "DuplicateKeyError",
    "FileSizeError",
    "Header",
    "HeaderEncodingError",
    "HeaderStructureError",
    "HeaderTooLargeError",
    "MetadataError",
    "OffsetsError",
    "SafetensorsFile",
    "SafetensorsFormatError",
    "ShapeError",
    "SizeMismatchError",
    "TensorInfo",
    "TruncatedFileError",
    "UnknownDTypeError",
    "cast_array",
    "decode_header",
    "dtype_of",
    "encode_header",
    "get_dtype",
    "layout_order",
    "read_header",
    "to_bf16",
    "to_f16",
    "write_shard",
]  # fmt: skip
