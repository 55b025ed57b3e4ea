"""The safetensors format core: dtypes, headers, casts, shard writing and reading.

numpy only: no Spark, no torch. Everything above this layer builds on these verbs.
"""

from .casts import cast_array, to_bf16, to_f16
from .dtypes import DTYPES, WRITABLE, DType, DTypeNameError, canonical_dtype, dtype_of, get_dtype
from .errors import (
    CastError,
    DuplicateKeyError,
    FileSizeError,
    HeaderEncodingError,
    HeaderStructureError,
    HeaderTooLargeError,
    MetadataError,
    NotRegularFileError,
    OffsetsError,
    SafetensorsFormatError,
    ShapeError,
    SizeMismatchError,
    TruncatedFileError,
    UnknownDTypeError,
)
from .header import (
    MAX_HEADER_BYTES,
    Header,
    HeaderLayout,
    TensorInfo,
    decode_header,
    encode_header,
    layout_header,
)
from .shard import (
    ChunkedTensor,
    PackedTensors,
    SafetensorsFile,
    read_header,
    write_packed,
    write_shard,
)

__all__ = [
    "DTYPES",
    "MAX_HEADER_BYTES",
    "WRITABLE",
    "CastError",
    "ChunkedTensor",
    "DType",
    "DTypeNameError",
    "DuplicateKeyError",
    "FileSizeError",
    "Header",
    "HeaderEncodingError",
    "HeaderLayout",
    "HeaderStructureError",
    "HeaderTooLargeError",
    "MetadataError",
    "NotRegularFileError",
    "OffsetsError",
    "PackedTensors",
    "SafetensorsFile",
    "SafetensorsFormatError",
    "ShapeError",
    "SizeMismatchError",
    "TensorInfo",
    "TruncatedFileError",
    "UnknownDTypeError",
    "canonical_dtype",
    "cast_array",
    "decode_header",
    "dtype_of",
    "encode_header",
    "get_dtype",
    "layout_header",
    "read_header",
    "to_bf16",
    "to_f16",
    "write_packed",
    "write_shard",
]  # fmt: skip
