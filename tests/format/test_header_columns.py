"""The bulk header decoder (columns, no object per tensor) against the general one.

Both decode every header: they must give the same tensors, metadata and data start, or
refuse with the same error type and message. Headers come from our encoder (the compact
form the bulk decoder takes), from the hostile corpus made compact, and from random
byte mutations of compact headers.
"""

import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hostile_files import CORPUS
from pyspark_safetensors.format import (
    DTYPES,
    DuplicateKeyError,
    SafetensorsFormatError,
    decode_header,
    encode_header,
)
from pyspark_safetensors.format.header import (
    Header,
    HeaderColumns,
    _decode_compact,
    _may_repeat,
    decode_header_columns,
)

BYTE_DTYPES = sorted(n for n, d in DTYPES.items() if d.bits % 8 == 0)
NAMES = st.text(
    st.characters(blacklist_categories=("Cs", "Cc"), blacklist_characters='"\\'), max_size=12
).filter(lambda s: s != "__metadata__")


def outcome(blob: bytes, fast: bool):
    """The decoded header, or the error, of one parser."""
    try:
        return decode_header(blob, len(blob), "f.safetensors", fast=fast)
    except SafetensorsFormatError as e:
        return e


def assert_same(blob: bytes):
    """Bulk and general agree exactly; returns the general outcome."""
    bulk, general = outcome(blob, True), outcome(blob, False)
    if isinstance(general, Exception):
        assert type(bulk) is type(general) and str(bulk) == str(general)
        with pytest.raises(type(general)) as info:
            decode_header_columns(blob, len(blob), "f.safetensors")
        assert str(info.value) == str(general)
        return general
    assert not isinstance(bulk, Exception), bulk
    assert bulk == general
    assert bulk.columns.infos() == general.tensors
    assert bulk.names() == [t.name for t in general.tensors]
    columns, metadata, data_start = decode_header_columns(blob, len(blob))
    assert columns.infos() == general.tensors
    assert (metadata, data_start) == (general.metadata, general.data_start)
    return general


def file_of(header_bytes: bytes, data_bytes: int) -> bytes:
    return header_bytes + b"\0" * data_bytes


@st.composite
def headers(draw):
    """A compact header of random names, dtypes and shapes (duplicate specs shared, as a
    KV shard's are), and its file."""
    names = draw(st.lists(NAMES, min_size=1, max_size=30, unique=True))
    specs = draw(
        st.lists(
            st.tuples(
                st.sampled_from(BYTE_DTYPES), st.lists(st.integers(0, 5), max_size=3).map(tuple)
            ),
            min_size=1,
            max_size=3,
        )
    )
    tensors = {
        n: (DTYPES[d], s)
        for n, (d, s) in zip(
            names,
            draw(st.lists(st.sampled_from(specs), min_size=len(names), max_size=len(names))),
            strict=True,
        )
    }
    metadata = draw(st.none() | st.dictionaries(NAMES, NAMES, max_size=3))
    header_bytes, infos = encode_header(tensors, metadata)
    return file_of(header_bytes, infos[-1].end)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(headers())
def test_bulk_decode_equals_the_general_one(blob):
    n = struct.unpack("<Q", blob[:8])[0]
    assert _decode_compact(blob[8 : 8 + n], len(blob), 8 + n, None) is not None  # bulk taken
    header = assert_same(blob)
    assert isinstance(header, Header)


MUTANT_BYTES = b'",:[]{}0189 aF\\\x01_-e'


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(headers(), st.data())
def test_bulk_decode_refuses_mutants_as_the_general_one(blob, data):
    n = struct.unpack("<Q", blob[:8])[0]
    edits = data.draw(
        st.lists(st.tuples(st.integers(8, 7 + n), st.sampled_from(list(MUTANT_BYTES))), max_size=3)
    )
    mutant = bytearray(blob)
    for at, value in edits:
        mutant[at] = value
    assert_same(bytes(mutant))


def compact(blob: bytes) -> bytes:
    """A corpus file with json.dumps' spaces taken out of its header."""
    if len(blob) < 8:
        return blob
    n = struct.unpack("<Q", blob[:8])[0]
    if 8 + n > len(blob):
        return blob
    body = blob[8 : 8 + n].rstrip(b" ").replace(b", ", b",").replace(b": ", b":")
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body + blob[8 + n :]


@pytest.mark.parametrize("name,data,error", CORPUS, ids=[c[0] for c in CORPUS])
def test_hostile_corpus_refused_alike(name, data, error):
    for blob in (data, compact(data)):
        assert isinstance(assert_same(blob), error)


def kv_header(names, offsets=None):
    """A compact KV header of F32 [2] tensors, its entries written as given."""
    offsets = offsets or [(8 * i, 8 * i + 8) for i in range(len(names))]
    body = ",".join(
        f'"{n}":{{"dtype":"F32","shape":[2],"data_offsets":[{b},{e}]}}'
        for n, (b, e) in zip(names, offsets, strict=True)
    )
    body = ("{" + body + "}").encode()
    body += b" " * (-len(body) % 8)
    return file_of(struct.pack("<Q", len(body)) + body, 8 * len(names))


def test_repeated_names_and_reserved_key_are_refused_alike():
    error = assert_same(kv_header(["a__x", "b__x", "a__x"]))
    assert isinstance(error, DuplicateKeyError) and "'a__x'" in str(error)
    assert isinstance(assert_same(kv_header(["a__x", "__metadata__"])), SafetensorsFormatError)


def test_offsets_out_of_order_holes_and_overlaps():
    names = [f"k{i}__x" for i in range(4)]
    shuffled = [(8, 16), (0, 8), (24, 32), (16, 24)]
    header = assert_same(kv_header(names, shuffled))
    assert [t.name for t in header.tensors] == ["k1__x", "k0__x", "k3__x", "k2__x"]
    assert isinstance(
        assert_same(kv_header(names, [(0, 8), (8, 16), (16, 24), (32, 40)])), Exception
    )
    assert isinstance(
        assert_same(kv_header(names, [(0, 8), (0, 8), (16, 24), (24, 32)])), Exception
    )


def test_columns_of_a_large_kv_header():
    """10^4 keys: the bulk decoder's columns, names as Arrow-layout bytes and offsets."""
    n = 10_000
    tensors = {f"key{i:05d}__acts": (DTYPES["F32"], (4,)) for i in range(n)}
    header_bytes, infos = encode_header(tensors, {"format": "pt"})
    blob = file_of(header_bytes, infos[-1].end)
    columns, metadata, data_start = decode_header_columns(blob, len(blob))
    assert metadata == {"format": "pt"} and data_start == len(header_bytes)
    assert columns.dtypes == (DTYPES["F32"],) and columns.shapes == ((4,),)
    assert not columns.dtype_of.any() and not columns.shape_of.any()
    np.testing.assert_array_equal(columns.begins, np.arange(n) * 16)
    np.testing.assert_array_equal(columns.ends, np.arange(1, n + 1) * 16)
    assert columns.names() == [t.name for t in infos]
    assert columns.name(n - 1) == f"key{n - 1:05d}__acts"
    assert HeaderColumns.of_infos(infos).infos() == tuple(infos)


def test_repeat_hash():
    def packed(names):
        encoded = [s.encode() for s in names]
        offsets = np.concatenate([[0], np.cumsum([len(e) for e in encoded])]).astype(np.int64)
        return np.frombuffer(b"".join(encoded), np.uint8), offsets

    assert not _may_repeat(*packed(["a", "b", "ab", "ba", "", "aa"]))
    assert _may_repeat(*packed(["a", "b", "ab", "b"]))
    assert _may_repeat(*packed(["", "x", ""]))
