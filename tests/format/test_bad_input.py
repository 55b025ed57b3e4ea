"""Malformed files: each gives its typed error naming the file and rule, never a crash."""

import json
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pyspark_safetensors.format import (
    DuplicateKeyError,
    FileSizeError,
    HeaderEncodingError,
    HeaderStructureError,
    HeaderTooLargeError,
    MetadataError,
    NotRegularFileError,
    OffsetsError,
    SafetensorsFile,
    SafetensorsFormatError,
    ShapeError,
    SizeMismatchError,
    TruncatedFileError,
    UnknownDTypeError,
    read_header,
    write_shard,
)
from pyspark_safetensors.format.errors import NotSafetensorsError


def raw_file(header, data=b"", pad=True):
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    if pad:
        body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body + data


def entry(dtype="F32", shape=(2,), offsets=(0, 8)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


# (name, file bytes, expected error)
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


@pytest.mark.parametrize("name,data,error", CORPUS, ids=[c[0] for c in CORPUS])
def test_bad_file_corpus(tmp_path, name, data, error):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(data)
    for opener in (read_header, SafetensorsFile):
        with pytest.raises(error) as info:
            opener(path)
        assert isinstance(info.value, ValueError)
        assert str(path) in str(info.value) and "rule:" in str(info.value)


def test_a_text_file_is_not_a_safetensors_file(tmp_path):
    """A text file's first 8 bytes read as a 19-digit header length: the error says what
    the file is not, rather than quoting the number alone."""
    path = tmp_path / "passwd"
    path.write_text("root:x:0:0:root:/root:/bin/bash\ndaemon:x:1:1::/usr/sbin:/bin/sh\n")
    for opener in (read_header, SafetensorsFile):
        with pytest.raises(NotSafetensorsError) as info:
            opener(path)
        message = str(info.value)
        assert message.startswith(f"file {str(path)!r}: not a safetensors file")
        assert "b'root:x:0'" in message and "past the end of the 64-byte file" in message
        assert isinstance(info.value, HeaderTooLargeError) and isinstance(info.value, ValueError)


def test_an_oversized_length_within_the_file_is_not_called_another_format(tmp_path):
    path = tmp_path / "big.safetensors"
    path.write_bytes(struct.pack("<Q", 100_000_001) + b"{" + b" " * 100_000_001)
    with pytest.raises(HeaderTooLargeError) as info:
        read_header(path)
    assert not isinstance(info.value, NotSafetensorsError)


def test_out_of_order_but_contiguous_offsets_are_valid(tmp_path):
    path = tmp_path / "ok.safetensors"
    data = np.arange(4, dtype=np.float32).tobytes()
    path.write_bytes(raw_file({"z": entry(offsets=(8, 16)), "a": entry(offsets=(0, 8))}, data))
    with SafetensorsFile(path) as f:
        assert f.tensor("a").tolist() == [0, 1] and f.tensor("z").tolist() == [2, 3]


def test_error_names_the_tensor(tmp_path):
    path = tmp_path / "t.safetensors"
    path.write_bytes(raw_file({"weights": entry(shape=(3,))}, b"\0" * 8))
    with pytest.raises(SizeMismatchError, match="tensor 'weights'"):
        read_header(path)


def _valid_file(tmp_path):
    path = tmp_path / "valid.safetensors"
    write_shard(
        path,
        {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.arange(3, dtype=np.int8)},
        {"k": "v"},
    )
    return path.read_bytes()


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_fuzz_mutated_valid_files(tmp_path, data):
    original = _valid_file(tmp_path)
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
    path = tmp_path / "mutant.safetensors"
    path.write_bytes(bytes(blob))
    try:
        with SafetensorsFile(path) as f:
            for name in f:
                t = f.tensor(name)
                info = f.header[name]
                assert t.nbytes == info.nbytes  # a file we accept is self-consistent
    except SafetensorsFormatError as e:
        assert str(path) in str(e)


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_only_regular_files_are_opened(tmp_path, kind):
    import os
    import threading

    path = tmp_path / "shard.safetensors"
    if kind == "directory":
        path.mkdir()
    else:
        os.mkfifo(path)
    errors = []

    def open_both():
        for opener in (read_header, SafetensorsFile):
            try:
                opener(path)
            except NotRegularFileError as e:
                errors.append(e)

    worker = threading.Thread(target=open_both, daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive(), "opening a FIFO blocked"
    assert len(errors) == 2 and all(str(path) in str(e) and "rule:" in str(e) for e in errors)


def test_an_empty_tensor_too_large_for_numpy_is_a_typed_error(tmp_path):
    path = tmp_path / "wide.safetensors"
    path.write_bytes(raw_file({"a": entry(shape=(0, 2**64 - 1), offsets=(0, 0))}))
    with SafetensorsFile(path) as f:  # valid for the format and the reference library
        assert f.header["a"].shape == (0, 2**64 - 1)
        with pytest.raises(ShapeError, match=r"tensor 'a'.*no numpy form"):
            f.tensor("a")
