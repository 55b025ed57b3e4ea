"""Malformed files: each gives its typed error naming the file and rule, never a crash."""

import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hostile_files import CORPUS, entry, mutate, raw_file
from pyspark_safetensors.format import (
    HeaderTooLargeError,
    NotRegularFileError,
    SafetensorsFile,
    SafetensorsFormatError,
    ShapeError,
    SizeMismatchError,
    read_header,
    write_shard,
)
from pyspark_safetensors.format.errors import NotSafetensorsError


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
    blob = mutate(data, original)
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
