"""Hostile safetensors files shared by the format tests and the Spark readers' tests: a
corpus of malformed files, each with the error the format layer raises, and random
mutations of a valid file."""

import json
import struct

from hypothesis import strategies as st

from pyspark_safetensors.format import (
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


def raw_file(header, data=b"", pad=True):
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    if pad:
        body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body + data


def entry(dtype="F32", shape=(2,), offsets=(0, 8)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


# (name, file bytes, the format layer's error)
CORPUS = [
    ("empty file", b"", TruncatedFileError),
    ("short length", b"\x08\x00\x00", TruncatedFileError),
    ("length past end", struct.pack("<Q", 64) + b"{}", TruncatedFileError),
    ("length 2^64-1", struct.pack("<Q", 2**64 - 1) + b"{}", HeaderTooLargeError),
    ("length 100MB+1", struct.pack("<Q", 100_000_001) + b"{}", HeaderTooLargeError),
    ("not utf-8", raw_file(b'{"\xff\xfe":1}'), HeaderEncodingError),
    ("not starting with brace", raw_file(b' {"a":1}'), HeaderEncodingError),
    ("not json", raw_file(b"{nope"), HeaderEncodingError),
    ("json array", raw_file(b"[1,2]"), HeaderEncodingError),
    ("entry not object", raw_file({"a": 3}), HeaderStructureError),
    ("entry missing keys", raw_file({"a": {"dtype": "F32"}}), HeaderStructureError),
    ("unknown dtype", raw_file({"a": entry(dtype="F128")}, b"\0" * 8), UnknownDTypeError),
    ("dtype not string", raw_file({"a": entry(dtype=7)}, b"\0" * 8), UnknownDTypeError),
    ("negative shape", raw_file({"a": entry(shape=(-2,))}, b"\0" * 8), ShapeError),
    ("float shape", raw_file({"a": entry(shape=(2.0,))}, b"\0" * 8), ShapeError),
    ("bool shape", raw_file({"a": entry(shape=(True,), offsets=(0, 4))}, b"\0" * 4), ShapeError),
    ("shape not list", raw_file({"a": {"dtype": "F32", "shape": 2, "data_offsets": [0, 8]}}, b"\0" * 8), ShapeError),
    ("size mismatch", raw_file({"a": entry(shape=(3,))}, b"\0" * 8), SizeMismatchError),
    ("huge shape", raw_file({"a": entry(shape=(2**40, 2**40))}, b"\0" * 8), ShapeError),
    ("offsets reversed", raw_file({"a": entry(offsets=(8, 0))}, b"\0" * 8), OffsetsError),
    ("offsets not pair", raw_file({"a": entry(offsets=(0,))}, b"\0" * 8), OffsetsError),
    ("hole", raw_file({"a": entry(offsets=(0, 8)), "b": entry(offsets=(16, 24))}, b"\0" * 24), OffsetsError),
    ("overlap", raw_file({"a": entry(offsets=(0, 8)), "b": entry(offsets=(4, 12))}, b"\0" * 12), OffsetsError),
    ("not from zero", raw_file({"a": entry(offsets=(8, 16))}, b"\0" * 16), OffsetsError),
    ("trailing bytes", raw_file({"a": entry()}, b"\0" * 9), FileSizeError),
    ("truncated data", raw_file({"a": entry()}, b"\0" * 7), FileSizeError),
    ("metadata not object", raw_file({"__metadata__": [1]}), MetadataError),
    ("metadata non-string value", raw_file({"__metadata__": {"a": 1}}), MetadataError),
    ("duplicate key", raw_file(b'{"a":' + json.dumps(entry()).encode() + b',"a":' + json.dumps(entry()).encode() + b"}", b"\0" * 8), DuplicateKeyError),
    ("deep nesting", raw_file(b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}"), SafetensorsFormatError),
]  # fmt: skip


def mutate(data, original: bytes) -> bytes:
    """``original`` with 1 to 4 random bit flips, truncations, extensions or overwrites
    drawn from hypothesis's ``data``."""
    blob = bytearray(original)
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "truncate", "extend", "overwrite"]))
        if op == "flip" and blob:
            i = data.draw(st.integers(0, len(blob) - 1))
            blob[i] ^= 1 << data.draw(st.integers(0, 7))
        elif op == "truncate":
            del blob[data.draw(st.integers(0, len(blob))) :]
        elif op == "extend":
            blob += data.draw(st.binary(min_size=1, max_size=16))
        elif blob:
            i = data.draw(st.integers(0, len(blob) - 1))
            chunk = data.draw(st.binary(min_size=1, max_size=8))
            blob[i : i + len(chunk)] = chunk
    return bytes(blob)
