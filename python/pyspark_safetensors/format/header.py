"""Header encoding and decoding, with every rule of the reference reader enforced.

Layout: 8-byte little-endian header length N, N bytes of UTF-8 JSON padded with spaces
to a multiple of 8, then the tensors' bytes. Offsets in the header are relative to the
start of the byte buffer (8 + N).
"""

from __future__ import annotations

import functools
import gc
import itertools
import json
import math
import operator
import re
import struct
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from json.encoder import encode_basestring
from typing import NamedTuple

import numpy as np

from .dtypes import DTYPES, DType
from .errors import (
    DuplicateKeyError,
    FileSizeError,
    HeaderEncodingError,
    HeaderStructureError,
    HeaderTooLargeError,
    InvalidArgumentError,
    MetadataError,
    NotSafetensorsError,
    OffsetsError,
    ShapeError,
    SizeMismatchError,
    TruncatedFileError,
    UnknownDTypeError,
)

MAX_HEADER_BYTES = 100_000_000
"""The reference library refuses larger headers; so do we, before reading them."""

METADATA_KEY = "__metadata__"
_NAME = operator.itemgetter(0)


class TensorInfo(NamedTuple):
    """One tensor entry of a header; ``begin``/``end`` are relative to the byte buffer.
    (A named tuple: KV shards hold hundreds of thousands of these.)"""

    name: str
    dtype: DType
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class Header:
    """A decoded header: tensors in byte-buffer order and the optional metadata.

    A header decoded in bulk holds its tensors as ``columns`` and makes the
    ``TensorInfo`` objects only when ``tensors`` (or a look-up by name) is first used."""

    __slots__ = ("_by_name", "_columns", "_tensors", "data_start", "metadata")

    def __init__(
        self, tensors: tuple[TensorInfo, ...], metadata: dict[str, str] | None, data_start: int
    ):
        self._tensors: tuple[TensorInfo, ...] | None = tuple(tensors)
        self._columns: HeaderColumns | None = None
        self._by_name: dict[str, TensorInfo] | None = None
        self.metadata = metadata
        self.data_start = data_start
        """Absolute file offset of the byte buffer (8 + N)."""

    @classmethod
    def of_columns(
        cls, columns: HeaderColumns, metadata: dict[str, str] | None, data_start: int
    ) -> Header:
        header = cls((), metadata, data_start)
        header._tensors, header._columns = None, columns
        return header

    @property
    def tensors(self) -> tuple[TensorInfo, ...]:
        if self._tensors is None:
            self._tensors = self._columns.infos()
        return self._tensors

    @property
    def columns(self) -> HeaderColumns:
        """The tensors as arrays (no Python object per tensor when decoded in bulk)."""
        if self._columns is None:
            self._columns = HeaderColumns.of_infos(self._tensors)
        return self._columns

    def _names(self) -> dict[str, TensorInfo]:
        if self._by_name is None:
            self._by_name = dict(zip(map(_NAME, self.tensors), self.tensors, strict=True))
        return self._by_name

    def __getitem__(self, name: str) -> TensorInfo:
        try:
            return self._names()[name]
        except KeyError:
            raise KeyError(f"no tensor named {name!r} in this file") from None

    def __contains__(self, name: object) -> bool:
        return name in self._names()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Header):
            return NotImplemented
        return (self.tensors, self.metadata, self.data_start) == (
            other.tensors,
            other.metadata,
            other.data_start,
        )

    __hash__ = None

    def __repr__(self) -> str:
        return f"Header({len(self._tensors if self._tensors is not None else self._columns)} tensors, metadata={self.metadata!r}, data_start={self.data_start})"

    def names(self) -> list[str]:
        if self._tensors is None:
            return self._columns.names()
        return list(self._names())

    @property
    def data_bytes(self) -> int:
        if self._tensors is None:
            return int(self._columns.ends[-1]) if len(self._columns) else 0
        return self.tensors[-1].end if self.tensors else 0

    @property
    def file_size(self) -> int:
        return self.data_start + self.data_bytes


@dataclass(frozen=True, eq=False)
class HeaderColumns:
    """A header's tensors as columns, in byte-buffer order: tensor ``i`` is named by the
    UTF-8 bytes ``name_data[name_offsets[i]:name_offsets[i + 1]]`` (Arrow's string
    layout), has dtype ``dtypes[dtype_of[i]]`` and shape ``shapes[shape_of[i]]``, and
    lies at ``[begins[i], ends[i])`` of the byte buffer."""

    name_data: np.ndarray
    """uint8."""
    name_offsets: np.ndarray
    """int64, one more than the tensors."""
    dtypes: tuple[DType, ...]
    dtype_of: np.ndarray
    shapes: tuple[tuple[int, ...], ...]
    shape_of: np.ndarray
    begins: np.ndarray
    ends: np.ndarray

    def __len__(self) -> int:
        return len(self.begins)

    def names(self) -> list[str]:
        data = self.name_data.tobytes()
        bounds = self.name_offsets.tolist()
        if data.isascii():  # str slices index characters, here the same as bytes
            text = data.decode("ascii")
            return [text[a:b] for a, b in itertools.pairwise(bounds)]
        return [data[a:b].decode("utf-8") for a, b in itertools.pairwise(bounds)]

    def name(self, i: int) -> str:
        a, b = self.name_offsets[i : i + 2].tolist()
        return self.name_data[a:b].tobytes().decode("utf-8")

    def infos(self) -> tuple[TensorInfo, ...]:
        with _gc_paused():
            return tuple(
                map(
                    functools.partial(tuple.__new__, TensorInfo),
                    zip(
                        self.names(),
                        map(self.dtypes.__getitem__, self.dtype_of.tolist()),
                        map(self.shapes.__getitem__, self.shape_of.tolist()),
                        self.begins.tolist(),
                        self.ends.tolist(),
                        strict=True,
                    ),
                )
            )

    @classmethod
    def of_infos(cls, infos) -> HeaderColumns:
        dtypes: dict[DType, int] = {}
        shapes: dict[tuple[int, ...], int] = {}
        encoded = [t.name.encode("utf-8") for t in infos]
        offsets = np.zeros(len(infos) + 1, dtype=np.int64)
        np.cumsum([len(e) for e in encoded], out=offsets[1:])
        n = len(infos)
        dtype_of = np.fromiter(
            (dtypes.setdefault(t.dtype, len(dtypes)) for t in infos), np.int64, n
        )
        shape_of = np.fromiter(
            (shapes.setdefault(t.shape, len(shapes)) for t in infos), np.int64, n
        )
        return cls(
            np.frombuffer(b"".join(encoded), np.uint8),
            offsets,
            tuple(dtypes),
            dtype_of,
            tuple(shapes),
            shape_of,
            np.fromiter((t.begin for t in infos), np.int64, n),
            np.fromiter((t.end for t in infos), np.int64, n),
        )


# --------------------------------------------------------------------------- encoding


Spec = tuple[DType, tuple[int, ...]]
"""A tensor's dtype and shape."""


@dataclass(frozen=True)
class HeaderLayout:
    """An encoded header kept as columns, for files of many tensors (a KV shard holds
    10^5): the file's tensor ``i`` is ``names[i]``, of dtype and shape
    ``specs[spec_of[i]]``, at ``[begins[i], ends[i])`` of the byte buffer, and was
    tensor ``order[i]`` of the caller's input."""

    header: bytes
    """Length prefix and padded JSON: the file's first ``data_start`` bytes."""
    names: list[str]
    specs: list[Spec]
    spec_of: np.ndarray
    begins: np.ndarray
    ends: np.ndarray
    order: np.ndarray

    @property
    def data_start(self) -> int:
        return len(self.header)

    @property
    def file_size(self) -> int:
        return self.data_start + (int(self.ends[-1]) if len(self.ends) else 0)

    def infos(self) -> list[TensorInfo]:
        specs = self.specs
        return [
            TensorInfo(name, *specs[s], b, e)
            for name, s, b, e in zip(
                self.names,
                self.spec_of.tolist(),
                self.begins.tolist(),
                self.ends.tolist(),
                strict=True,
            )
        ]


def _checked_spec(
    spec: Spec, names: list[str], spec_of: np.ndarray, index: int
) -> tuple[Spec, int]:
    """The spec with plain-int dims and its bytes per tensor, refused where the reference
    reader would refuse it; errors name a tensor using it."""
    dtype, shape = spec
    shape = tuple(map(int, shape))

    def user() -> str | None:
        users = np.flatnonzero(spec_of == index)
        return names[int(users[0])] if len(users) else None

    if any(s < 0 or s > U64_MAX for s in shape):
        raise ShapeError(f"shape {list(shape)} has a dimension outside 0..2^64-1", tensor=user())
    try:
        nbytes = _checked_nbytes(dtype, shape)
    except ShapeError as e:
        raise ShapeError(e.detail, tensor=user()) from None
    if nbytes is None:
        raise SizeMismatchError(
            f"{dtype} elements of shape {list(shape)} do not end on a byte", tensor=user()
        )
    if nbytes >= 2**63:
        raise ShapeError(f"shape {list(shape)} of {dtype} needs {nbytes} bytes", tensor=user())
    return (dtype, shape), nbytes


def layout_header(
    names: list[str],
    specs: list[Spec],
    spec_of: np.ndarray,
    metadata: Mapping[str, str] | None = None,
) -> HeaderLayout:
    """Lay out and encode the header of tensors ``names[i]`` with ``specs[spec_of[i]]``.

    Tensors are placed as the reference library places them (dtype rank descending, then
    name); the work per tensor is one sort and one string format, so 10^5 tensors take
    tens of milliseconds. Names must be unique; ``__metadata__`` is reserved.
    """
    spec_of = np.asarray(spec_of, dtype=np.int64)
    if len(names) != len(spec_of):
        raise InvalidArgumentError(f"{len(names)} names for {len(spec_of)} tensors")
    if metadata is not None:
        _check_metadata(metadata, path=None)
    unique = set(names)
    if len(unique) != len(names):
        seen: set[str] = set()
        duplicate = next(n for n in names if n in seen or seen.add(n))
        raise DuplicateKeyError(f"two tensors are named {duplicate!r}", tensor=duplicate)
    if METADATA_KEY in unique:
        raise InvalidArgumentError(f"{METADATA_KEY!r} is reserved and cannot name a tensor")
    checked = [_checked_spec(spec, names, spec_of, i) for i, spec in enumerate(specs)]
    specs = [spec for spec, _ in checked]
    spec_bytes = np.array([nbytes for _, nbytes in checked] or [0], dtype=np.int64)
    ranks = np.array([dtype.rank for dtype, _ in specs] or [0], dtype=np.int64)

    order = np.array(sorted(range(len(names)), key=names.__getitem__), dtype=np.int64)
    if len(set(ranks.tolist())) > 1:  # widest dtype first; names stay sorted within a rank
        order = order[np.argsort(-ranks[spec_of[order]], kind="stable")]
    file_names = [names[i] for i in order.tolist()]
    file_specs = spec_of[order]
    ends = np.cumsum(spec_bytes[file_specs], dtype=np.int64)
    begins = ends - spec_bytes[file_specs]

    parts = []
    if metadata is not None:
        items = ",".join(
            f"{encode_basestring(k)}:{encode_basestring(metadata[k])}" for k in sorted(metadata)
        )
        parts.append(f'"{METADATA_KEY}":{{{items}}}')
    entry = [
        f':{{"dtype":"{dtype.name}","shape":[{",".join(map(str, shape))}],"data_offsets":['
        for dtype, shape in specs
    ]
    parts += [
        f"{encode_basestring(name)}{entry[s]}{b},{e}]}}"
        for name, s, b, e in zip(
            file_names, file_specs.tolist(), begins.tolist(), ends.tolist(), strict=False
        )
    ]
    # The reference writes compact serde_json: same separators, non-ASCII kept as UTF-8.
    try:
        body = ("{" + ",".join(parts) + "}").encode("utf-8")
    except UnicodeEncodeError:
        _refuse_surrogates(file_names, metadata)
        raise
    body += b" " * (-len(body) % 8)
    return HeaderLayout(
        struct.pack("<Q", len(body)) + body, file_names, specs, file_specs, begins, ends, order
    )


def _refuse_surrogates(names: list[str], metadata: Mapping[str, str] | None) -> None:
    """A lone UTF-16 surrogate has no UTF-8 form: name the tensor or metadata key holding it."""
    for name in names:
        if _SURROGATES.search(name):
            raise HeaderEncodingError(
                "tensor name holds a lone UTF-16 surrogate, which UTF-8 cannot encode",
                tensor=name,
            )
    for k, v in (metadata or {}).items():
        if _SURROGATES.search(k) or _SURROGATES.search(v):
            raise HeaderEncodingError(
                f"{METADATA_KEY} entry {k!r}: {v!r} holds a lone UTF-16 surrogate, which UTF-8 "
                "cannot encode"
            )


def encode_header(
    tensors: Mapping[str, Spec],
    metadata: Mapping[str, str] | None = None,
) -> tuple[bytes, list[TensorInfo]]:
    """Encode a header for ``{name: (dtype, shape)}``.

    Returns the bytes to write before the data (length prefix + padded JSON) and the
    tensor entries in the order their bytes must follow. For the same tensors and at most
    one metadata key, the bytes equal ``safetensors.torch.save``'s; metadata keys are
    written sorted (the reference writes them in hash-map order, which varies by process).
    """
    ids: dict[Spec, int] = {}
    spec_of = np.array(
        [ids.setdefault((dtype, tuple(shape)), len(ids)) for dtype, shape in tensors.values()],
        dtype=np.int64,
    )
    layout = layout_header(list(tensors), list(ids), spec_of, metadata)
    return layout.header, layout.infos()


# --------------------------------------------------------------------------- decoding


def read_header_length(prefix: bytes, file_size: int, path: str | None = None) -> int:
    """Check the 8-byte length prefix against the file size; returns N."""
    if len(prefix) < 8 or file_size < 8:
        raise TruncatedFileError(
            f"file is {file_size} bytes, shorter than the 8-byte header length", path=path
        )
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > MAX_HEADER_BYTES and 8 + n > file_size:
        raise NotSafetensorsError(
            f"not a safetensors file: its first 8 bytes {bytes(prefix[:8])!r} read as header "
            f"length {n:,}, over the {MAX_HEADER_BYTES:,}-byte limit and past the end of "
            f"the {file_size:,}-byte file",
            path=path,
        )
    if n > MAX_HEADER_BYTES:
        raise HeaderTooLargeError(f"header length {n} exceeds {MAX_HEADER_BYTES}", path=path)
    if 8 + n > file_size:
        raise TruncatedFileError(
            f"header length {n} runs past the end of the {file_size}-byte file", path=path
        )
    return n


# The accepted header language is the reference library's (safetensors 0.8, serde_json),
# less two things we refuse on purpose: a key repeated in any object (the reference keeps
# the last one silently) and anything before the opening '{' (the format says the header
# MUST begin with it; the reference also skips JSON whitespace there).

U64_MAX = 2**64 - 1
"""Dimensions and offsets are ``usize`` in the reference reader."""

MAX_JSON_DEPTH = 127
"""serde_json's recursion limit: the reference refuses the 128th nested array/object."""

_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATES = re.compile("[\ud800-\udfff]")


def _no_duplicates(path):
    def hook(pairs):
        obj = {}
        for k, v in pairs:
            if k in obj:
                raise DuplicateKeyError(f"key {k!r} appears twice", path=path, tensor=k)
            obj[k] = v
        return obj

    return hook


def _strict_json(path) -> json.JSONDecoder:
    """A decoder of the JSON serde_json accepts: no NaN/Infinity, no number that
    overflows a float64, ``-0`` read as a float (so it is no ``usize``), no duplicate key."""

    def constant(name):
        raise HeaderEncodingError(f"{name} is not JSON", path=path)

    def number(literal):
        value = float(literal)
        if math.isinf(value):
            raise HeaderEncodingError(f"number {literal[:40]} is out of range", path=path)
        return value

    def integer(literal):
        digits = len(literal) - literal.startswith("-")
        if digits > 309:  # beyond float64 (and Python's int-parsing limit): serde refuses it
            raise HeaderEncodingError(f"number {literal[:40]}... is out of range", path=path)
        value = int(literal)
        if digits == 309:
            try:
                float(value)
            except OverflowError:
                raise HeaderEncodingError(
                    f"number {literal[:40]}... is out of range", path=path
                ) from None
        return -0.0 if value == 0 and literal[0] == "-" else value

    return json.JSONDecoder(
        object_pairs_hook=_no_duplicates(path),
        parse_constant=constant,
        parse_float=number,
        parse_int=integer,
    )


def _check_json_values(value, path, depth: int = 1, surrogates: bool = True) -> None:
    """Refuse what the reference's JSON parser refuses past our decoder: nesting deeper
    than ``MAX_JSON_DEPTH`` and strings holding a lone UTF-16 surrogate (``"\\ud800"``)."""
    if isinstance(value, dict | list):
        if depth > MAX_JSON_DEPTH:
            raise HeaderEncodingError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels", path=path)
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for k, v in items:
            if surrogates and isinstance(k, str) and _SURROGATES.search(k):
                raise HeaderEncodingError(f"key {k!r} holds a lone UTF-16 surrogate", path=path)
            _check_json_values(v, path, depth + 1, surrogates)
    elif surrogates and isinstance(value, str) and _SURROGATES.search(value):
        raise HeaderEncodingError(f"string {value!r} holds a lone UTF-16 surrogate", path=path)


def _check_metadata(metadata, path):
    if not isinstance(metadata, Mapping):
        raise MetadataError(
            f"{METADATA_KEY} is a {type(metadata).__name__}, not an object", path=path
        )
    for k, v in metadata.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise MetadataError(
                f"{METADATA_KEY} entry {k!r}: {v!r} is not string to string", path=path
            )


def _is_usize(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= U64_MAX


def _checked_numel(shape, path=None, tensor=None) -> int:
    """The element count, refused as the reference refuses it: when the running product
    (left to right) leaves 64 bits, even if a later dimension is 0."""
    numel = 1
    for d in shape:
        numel *= d
        if numel > U64_MAX:
            raise ShapeError(
                f"shape {list(shape)}: the element count overflows 64 bits",
                path=path,
                tensor=tensor,
            )
    return numel


def _checked_nbytes(dtype: DType, shape, path=None, tensor=None) -> int | None:
    """Bytes of a tensor (None when its elements do not end on a byte), with the
    reference's 64-bit overflow rule for the element count and the bit count."""
    bits = _checked_numel(shape, path, tensor) * dtype.bits
    if bits > U64_MAX:
        raise ShapeError(
            f"shape {list(shape)} of {dtype}: the size in bits overflows 64 bits",
            path=path,
            tensor=tensor,
        )
    return bits // 8 if bits % 8 == 0 else None


def decode_header(
    raw: bytes, file_size: int, path: str | None = None, *, fast: bool = True
) -> Header:
    """Decode and validate a header.

    ``raw`` holds at least the first 8 + N bytes of the file; ``file_size`` is the whole
    file's length. Raises a ``SafetensorsFormatError`` subclass naming the rule broken.
    ``fast`` tries the bulk parser of compact headers (what this library and the
    reference write) first; anything it does not recognise as valid goes to the general
    JSON parser, which alone produces errors. ``fast=False`` uses only the general one.
    """
    n = read_header_length(raw, file_size, path)
    body = raw[8 : 8 + n]
    if len(body) < n:
        raise TruncatedFileError(f"only {len(body)} of the {n} header bytes are present", path=path)
    data = bytes(body)
    text = None
    if not data.isascii():  # ASCII is UTF-8; anything else is decoded to be checked
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise HeaderEncodingError(
                f"header is not valid UTF-8 ({e.reason} at byte {e.start})", path=path
            ) from None
    if not data.startswith(b"{"):
        raise HeaderEncodingError("header does not start with '{'", path=path)
    if fast:
        header = _decode_compact(data, file_size, 8 + n, path, text)
        if header is not None:
            return header
    return _decode_general(data.decode("utf-8") if text is None else text, file_size, 8 + n, path)


def decode_header_columns(
    raw: bytes, file_size: int, path: str | None = None
) -> tuple[HeaderColumns, dict[str, str] | None, int]:
    """``decode_header`` for files of many tensors: ``(columns, metadata, data_start)``,
    with the same checks and errors, and no Python object per tensor where the header
    is compact (as this library and the reference write it)."""
    header = decode_header(raw, file_size, path)
    return header.columns, header.metadata, header.data_start


def _decode_general(text: str, file_size: int, data_start: int, path) -> Header:
    """The reference twin: the full JSON language, one entry at a time."""
    try:
        doc = _strict_json(path).decode(text)
    except json.JSONDecodeError as e:
        raise HeaderEncodingError(
            f"header is not valid JSON: {e.msg} at char {e.pos}", path=path
        ) from None
    except RecursionError:
        raise HeaderEncodingError(
            f"JSON nested deeper than {MAX_JSON_DEPTH} levels", path=path
        ) from None
    if not isinstance(doc, dict):
        raise HeaderStructureError("header JSON is not an object", path=path)
    _check_json_values(doc, path, surrogates=_SURROGATE_ESCAPE.search(text) is not None)

    metadata = doc.pop(METADATA_KEY, None)
    if metadata is not None:
        _check_metadata(metadata, path)

    infos = [_decode_entry(name, entry, path) for name, entry in doc.items()]
    infos.sort(key=lambda t: (t.begin, t.end))
    position = 0
    for t in infos:
        if t.begin != position:
            what = "a hole before" if t.begin > position else "an overlap at"
            raise OffsetsError(
                f"{what} data_offsets [{t.begin}, {t.end}] (expected begin {position})",
                path=path,
                tensor=t.name,
            )
        position = t.end
    if data_start + position != file_size:
        kind = "truncated" if data_start + position > file_size else "trailing bytes"
        raise FileSizeError(
            f"{kind}: header + tensors need {data_start + position} bytes, the file has {file_size}",
            path=path,
        )
    return Header(tuple(infos), metadata, data_start)


def _decode_entry(name: str, entry, path) -> TensorInfo:
    if not isinstance(entry, dict):
        raise HeaderStructureError(
            f"entry is a {type(entry).__name__}, not an object", path=path, tensor=name
        )
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in entry]
    if missing:
        raise HeaderStructureError(f"entry lacks {', '.join(missing)}", path=path, tensor=name)
    dtype = DTYPES.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
    if dtype is None:
        raise UnknownDTypeError(f"unknown dtype {entry['dtype']!r}", path=path, tensor=name)
    shape = entry["shape"]
    if not isinstance(shape, list) or not all(_is_usize(s) for s in shape):
        raise ShapeError(
            f"shape {_clip(shape)} is not a list of integers in 0..2^64-1", path=path, tensor=name
        )
    offsets = entry["data_offsets"]
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_usize(o) for o in offsets)):
        raise OffsetsError(
            f"data_offsets {_clip(offsets)} is not [begin, end] of integers in 0..2^64-1",
            path=path,
            tensor=name,
        )
    begin, end = offsets
    if end < begin:
        raise OffsetsError(
            f"data_offsets [{begin}, {end}] end before they begin", path=path, tensor=name
        )
    nbytes = _checked_nbytes(dtype, shape, path, name)
    if nbytes != end - begin:
        raise SizeMismatchError(
            f"shape {shape} of {dtype} needs {nbytes if nbytes is not None else 'a fractional number of'} bytes, "
            f"data_offsets [{begin}, {end}] hold {end - begin}",
            path=path,
            tensor=name,
        )
    return TensorInfo(name, dtype, tuple(shape), begin, end)


def _clip(value) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


# --------------------------------------------------------------------------- fast path
#
# A compact header (no whitespace, no escapes in names, entries of exactly the form
# "name":{"dtype":"..","shape":[..],"data_offsets":[b,e]}) has ten '"' per tensor, so the
# text between its quotes falls into ten slots per tensor at fixed places. Everything is
# checked per slot with numpy over the header's bytes (fixed slots compared whole, the few
# distinct dtype and shape texts parsed once, offsets parsed in one pass), with no Python
# object per tensor. Whatever is not exactly that, or not valid, returns None and takes
# the general path, so errors and unusual headers are always the general path's.

_COMPACT_SHAPE = re.compile(r":\[(?:(?:0|[1-9][0-9]{0,19})(?:,(?:0|[1-9][0-9]{0,19}))*)?\],")
_COMPACT_OFFSETS = re.compile(rb"(?::\[(?:0|[1-9][0-9]{0,17}),(?:0|[1-9][0-9]{0,17})\]\},)+")
_FIXED = ((1, 4, b'":{"dtype":"'), (5, 7, b'","shape"'), (8, 9, b'"data_offsets"'))
"""The fixed slots, as runs of text from quote ``a`` to quote ``b`` of an entry."""
_METADATA_PREFIX = b'{"' + METADATA_KEY.encode() + b'":'
_FAST_NUMEL_LIMIT = 2**56  # numel x bits stays inside int64 below this
_HASH_BASE = np.uint64(0x9E3779B97F4A7C15)
_QUOTE, _COLON = ord('"'), ord(":")


@contextmanager
def _gc_paused():
    """Building 10^5 tuples would otherwise trigger repeated generational collections
    that scan every earlier one; nothing here makes reference cycles."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _cut(data: np.ndarray, begins: np.ndarray, ends: np.ndarray):
    """The byte strings ``data[begins[i]:ends[i]]`` one after another, and their offsets."""
    lengths = ends - begins
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    index = np.arange(int(offsets[-1]), dtype=np.int64)
    index += np.repeat(begins - offsets[:-1], lengths)
    return data[index], offsets


def _distinct(data: np.ndarray, offsets: np.ndarray) -> tuple[list[bytes], np.ndarray]:
    """The distinct byte strings of ``_cut``'s output, and each one's index among them."""
    n = len(offsets) - 1
    lengths = np.diff(offsets)
    if (lengths == lengths[0]).all():
        rows = data.reshape(n, int(lengths[0]))
        if (rows == rows[0]).all():  # the usual case: one dtype, one shape
            return [rows[0].tobytes()], np.zeros(n, dtype=np.int64)
    blob, bounds = data.tobytes(), offsets.tolist()
    texts = [blob[a:b] for a, b in itertools.pairwise(bounds)]
    ids: dict[bytes, int] = {}
    of = np.fromiter((ids.setdefault(t, len(ids)) for t in texts), np.int64, n)
    return list(ids), of


def _may_repeat(data: np.ndarray, offsets: np.ndarray) -> bool:
    """Whether two of the byte strings may be equal: equal 64-bit polynomial hashes (a
    collision only sends the header to the general path, which decides exactly)."""
    lengths = np.diff(offsets)
    if len(lengths) < 2:
        return False
    position = np.arange(len(data), dtype=np.int64) - np.repeat(offsets[:-1], lengths)
    powers = np.cumprod(np.full(int(lengths.max()) + 1, _HASH_BASE, dtype=np.uint64))
    sums = np.zeros(len(data) + 1, dtype=np.uint64)
    np.cumsum(data.astype(np.uint64) * powers[position], out=sums[1:])  # wraps mod 2^64
    hashes = (sums[offsets[1:]] - sums[offsets[:-1]]) ^ (lengths.astype(np.uint64) * powers[0])
    hashes.sort()
    return bool((hashes[1:] == hashes[:-1]).any())


def _compact_metadata(data: bytes, text: str | None, path):
    """The metadata of a compact header and the byte offset of its first tensor entry, or
    None when there is no metadata of the compact form."""
    if not data.startswith(_METADATA_PREFIX):
        return None, 1
    ascii = text is None  # then character offsets are byte offsets
    size = 1 << 16  # the metadata is small: decode a prefix first, not the whole header
    while True:
        head = data[:size].decode("ascii") if ascii else text[:size]
        try:
            metadata, pos = _strict_json(path).raw_decode(head, len(_METADATA_PREFIX))
            _check_json_values(metadata, path, depth=2)
            _check_metadata(metadata, path)
            break
        except (ValueError, RecursionError):
            if size >= len(data):
                return None
            size *= 4
    if not ascii:
        pos = len(text[:pos].encode("utf-8"))
    if data[pos : pos + 1] != b",":
        return None
    return metadata, pos + 1


def _compact_shapes(shape_texts: list[str]):
    """(the distinct shapes, their element counts), or None when a shape is not one the
    fast path takes."""
    shapes = []
    for s in shape_texts:
        if not _COMPACT_SHAPE.fullmatch(s):
            return None
        shape = tuple(map(int, s[2:-2].split(","))) if len(s) > 4 else ()
        if any(d > U64_MAX for d in shape):
            return None
        shapes.append(shape)
    try:
        numel = [_checked_numel(s) for s in shapes]
    except ShapeError:
        return None  # the general path names the tensor
    if max(numel) >= _FAST_NUMEL_LIMIT:
        return None
    return shapes, numel


def _compact_entries(data: bytes, text: str | None, path):
    """(metadata, entries) of a compact header: its metadata (None when it has none) and
    the bytes of its tensor entries as uint8, each followed by a comma; None when the
    header is not of that form or its entries hold escapes or control characters."""
    body = data.rstrip(b" \t\n\r")
    if not body.endswith(b"}"):
        return None
    found = _compact_metadata(body, text, path)
    if found is None:
        return None
    metadata, pos = found
    entries = np.frombuffer(body[pos:-1] + b",", np.uint8)
    if (entries < 0x20).any() or (entries == ord("\\")).any():  # escapes, control characters
        return None
    return metadata, entries


def _entry_slots(entries: np.ndarray):
    """(begins, ends), ``[n, 10]`` each: slot k of tensor i is ``entries[begins[i, k]:
    ends[i, k]]``, after its quote k up to the next quote (0 the name, 4 the dtype, 7 the
    shape, 9 the offsets); None unless every entry has its ten quotes and fixed slots."""
    quotes = np.flatnonzero(entries == _QUOTE)
    n = len(quotes) // 10
    if n == 0 or len(quotes) != 10 * n or quotes[0] != 0:
        return None
    quotes = quotes.reshape(n, 10)
    begins = quotes + 1
    ends = np.empty_like(quotes)
    ends[:, :9] = quotes[:, 1:]
    ends[:-1, 9] = quotes[1:, 0]
    ends[-1, 9] = len(entries)
    for a, b, piece in _FIXED:
        if not (quotes[:, b] - quotes[:, a] == len(piece) - 1).all():
            return None
        got = entries[quotes[:, a, None] + np.arange(len(piece))]
        if not (got == np.frombuffer(piece, np.uint8)).all():
            return None
    return begins, ends


def _compact_offsets(entries: np.ndarray, begins: np.ndarray, ends: np.ndarray):
    """(starts, stops) of the tensors from their offsets slots (``:[start,stop]},``), or
    None when a slot is not exactly one such pair."""
    # Each slot starts with ':', which a run of pairs holds only at a pair's start: n
    # slots matching n pairs are one pair each.
    offsets_text = _cut(entries, begins, ends)[0].tobytes()
    if not (entries[begins] == _COLON).all() or not _COMPACT_OFFSETS.fullmatch(offsets_text):
        return None
    # np.fromstring's text mode (sep), not its removed binary mode; the text was checked above.
    numbers = np.fromstring(offsets_text.replace(b"]},:[", b",")[2:-3], dtype=np.int64, sep=",")
    if len(numbers) != 2 * len(begins):
        return None
    return numbers[0::2], numbers[1::2]


def _buffer_order(starts: np.ndarray, stops: np.ndarray) -> np.ndarray | None:
    """The permutation that puts the tensors in byte-buffer order (by start, then stop),
    or None when they are in that order already (the usual case: no sort)."""
    in_order = (starts[1:] > starts[:-1]) | (
        (starts[1:] == starts[:-1]) & (stops[1:] >= stops[:-1])
    )
    return None if in_order.all() else np.lexsort((stops, starts))


def _tiles_buffer(starts: np.ndarray, stops: np.ndarray, file_size: int, data_start: int) -> bool:
    """Whether the byte ranges, in buffer order, cover the byte buffer exactly: from 0,
    each starting where the previous stops, the last ending with the file."""
    return not (
        starts[0] != 0
        or (starts[1:] != stops[:-1]).any()
        or data_start + int(stops[-1]) != file_size
    )


def _names_distinct(name_data: np.ndarray, name_offsets: np.ndarray) -> bool:
    """Whether the names are surely distinct and none is ``__metadata__`` (else the
    general path decides and says which)."""
    if _may_repeat(name_data, name_offsets):
        return False
    reserved = METADATA_KEY.encode()
    lengths = np.diff(name_offsets)
    for i in np.flatnonzero(lengths == len(reserved)).tolist():
        if name_data[name_offsets[i] : name_offsets[i + 1]].tobytes() == reserved:
            return False
    return True


def _compact_columns(data: bytes, text: str | None, file_size: int, data_start: int, path):
    """(columns, metadata) of a compact, valid header, else None."""
    found = _compact_entries(data, text, path)
    if found is None:
        return None
    metadata, entries = found
    slots = _entry_slots(entries)
    if slots is None:
        return None
    begins, ends = slots
    dtype_texts, dtype_of = _distinct(*_cut(entries, begins[:, 4], ends[:, 4]))
    dtypes = [DTYPES.get(t.decode("utf-8")) for t in dtype_texts]
    if None in dtypes:
        return None
    shape_texts, shape_of = _distinct(*_cut(entries, begins[:, 7], ends[:, 7]))
    shaped = _compact_shapes([t.decode("utf-8") for t in shape_texts])
    if shaped is None:
        return None
    shapes, numel = shaped
    offsets = _compact_offsets(entries, begins[:, 9], ends[:, 9])
    if offsets is None:
        return None
    starts, stops = offsets
    bits = (
        np.array([d.bits for d in dtypes], dtype=np.int64)[dtype_of]
        * np.array(numel, dtype=np.int64)[shape_of]
    )
    if (bits % 8).any() or ((stops - starts) * 8 != bits).any():
        return None
    name_begins, name_ends = begins[:, 0], ends[:, 0]
    order = _buffer_order(starts, stops)
    if order is not None:
        starts, stops, dtype_of, shape_of = (
            starts[order],
            stops[order],
            dtype_of[order],
            shape_of[order],
        )
        name_begins, name_ends = name_begins[order], name_ends[order]
    if not _tiles_buffer(starts, stops, file_size, data_start):
        return None
    name_data, name_offsets = _cut(entries, name_begins, name_ends)
    if not _names_distinct(name_data, name_offsets):
        return None
    columns = HeaderColumns(
        name_data, name_offsets, tuple(dtypes), dtype_of, tuple(shapes), shape_of, starts, stops
    )
    return columns, metadata


def _decode_compact(
    data: bytes | str, file_size: int, data_start: int, path, text: str | None = None
) -> Header | None:
    """The header of a compact, valid header text (``data``: its bytes, or its text),
    its tensors kept as columns; None for anything else."""
    if isinstance(data, str):
        data, text = data.encode("utf-8"), data
    if data.isascii():
        text = None  # character offsets are byte offsets
    elif text is None:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            return None
    found = _compact_columns(data, text, file_size, data_start, path)
    if found is None:
        return None
    return Header.of_columns(found[0], found[1], data_start)
