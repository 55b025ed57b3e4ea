"""Header encoding and decoding, with every rule of the reference reader enforced.

Layout: 8-byte little-endian header length N, N bytes of UTF-8 JSON padded with spaces
to a multiple of 8, then the tensors' bytes. Offsets in the header are relative to the
start of the byte buffer (8 + N).
"""

from __future__ import annotations

import functools
import gc
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


@dataclass(frozen=True)
class Header:
    """A decoded header: tensors in byte-buffer order and the optional metadata."""

    tensors: tuple[TensorInfo, ...]
    metadata: dict[str, str] | None
    data_start: int
    """Absolute file offset of the byte buffer (8 + N)."""

    def __post_init__(self):
        object.__setattr__(
            self, "_by_name", dict(zip(map(_NAME, self.tensors), self.tensors, strict=True))
        )

    def __getitem__(self, name: str) -> TensorInfo:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"no tensor named {name!r} in this file") from None

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def names(self) -> list[str]:
        return list(self._by_name)

    @property
    def data_bytes(self) -> int:
        return self.tensors[-1].end if self.tensors else 0

    @property
    def file_size(self) -> int:
        return self.data_start + self.data_bytes


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
    try:
        text = bytes(body).decode("utf-8")
    except UnicodeDecodeError as e:
        raise HeaderEncodingError(
            f"header is not valid UTF-8 ({e.reason} at byte {e.start})", path=path
        ) from None
    if not text.startswith("{"):
        raise HeaderEncodingError("header does not start with '{'", path=path)
    if fast:
        header = _decode_compact(text, file_size, 8 + n, path)
        if header is not None:
            return header
    return _decode_general(text, file_size, 8 + n, path)


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
# "name":{"dtype":"..","shape":[..],"data_offsets":[b,e]}) splits on '"' into ten pieces
# per tensor at fixed positions; everything is then checked per column with list.count,
# regular expressions over joined strings and numpy, with no Python object per tensor
# but its TensorInfo. Whatever is not exactly that, or not valid, returns None and takes
# the general path, so errors and unusual headers are always the general path's.

_COMPACT_SHAPE = re.compile(r":\[(?:(?:0|[1-9][0-9]{0,19})(?:,(?:0|[1-9][0-9]{0,19}))*)?\],")
_COMPACT_PAIR = r":\[(?:0|[1-9][0-9]{0,17}),(?:0|[1-9][0-9]{0,17})\]\},"
_COMPACT_OFFSETS = re.compile(f'{_COMPACT_PAIR}(?:"{_COMPACT_PAIR})*')
_NEEDS_GENERAL = re.compile(r"[\\\x00-\x1f]")  # escapes and control characters
_FIXED = ((2, ":{"), (3, "dtype"), (4, ":"), (6, ","), (7, "shape"), (9, "data_offsets"))
_METADATA_PREFIX = '{"' + METADATA_KEY + '":'
_FAST_NUMEL_LIMIT = 2**56  # numel x bits stays inside int64 below this


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


def _compact_pieces(body: str, path):
    """The metadata and the four per-tensor columns (names, dtype names, shape texts,
    offset texts) of a compact header, or None when it is not one."""
    metadata, pos = None, 1
    if body.startswith(_METADATA_PREFIX):
        try:
            metadata, pos = _strict_json(path).raw_decode(body, len(_METADATA_PREFIX))
            _check_json_values(metadata, path, depth=2)
            _check_metadata(metadata, path)
        except (ValueError, RecursionError):
            return None
        if body[pos : pos + 1] != ",":
            return None
        pos += 1
    parts = (body[pos:-1] + ",").split('"')
    n = len(parts) // 10
    if n == 0 or len(parts) != 10 * n + 1 or parts[0]:
        return None
    if any(parts[k::10].count(piece) != n for k, piece in _FIXED):
        return None
    names = parts[1::10]
    if _NEEDS_GENERAL.search("".join(names)):  # the only free text; other slots are checked
        return None
    return metadata, names, parts[5::10], parts[8::10], parts[10::10]


def _compact_shapes(shape_texts: list[str]):
    """(the distinct shapes, their ids by text, their element counts), or None when a
    shape is not one the fast path takes."""
    shapes_by_text = {}
    for s in dict.fromkeys(shape_texts):
        if not _COMPACT_SHAPE.fullmatch(s):
            return None
        shape = tuple(map(int, s[2:-2].split(","))) if len(s) > 4 else ()
        if any(d > U64_MAX for d in shape):
            return None
        shapes_by_text[s] = shape
    shapes = list(shapes_by_text.values())
    try:
        numel = [_checked_numel(s) for s in shapes]
    except ShapeError:
        return None  # the general path names the tensor
    if max(numel) >= _FAST_NUMEL_LIMIT:
        return None
    return shapes, {s: i for i, s in enumerate(shapes_by_text)}, numel


def _decode_compact(text: str, file_size: int, data_start: int, path) -> Header | None:
    body = text.rstrip(" \t\n\r")
    if not body.endswith("}"):
        return None
    pieces = _compact_pieces(body, path)
    if pieces is None:
        return None
    metadata, names, dtype_names, shape_texts, offset_texts = pieces
    n = len(names)
    dtypes = [DTYPES.get(d) for d in dict.fromkeys(dtype_names)]
    if None in dtypes:
        return None
    dtype_ids = {d.name: i for i, d in enumerate(dtypes)}
    shaped = _compact_shapes(shape_texts)
    if shaped is None:
        return None
    shapes, shape_ids, numel = shaped
    # Joined with '"' (which no slot holds), so the pattern checks every tensor's own slot.
    offsets_text = '"'.join(offset_texts)
    if not _COMPACT_OFFSETS.fullmatch(offsets_text):
        return None
    # np.fromstring's text mode (sep), not its removed binary mode; the text was checked above.
    numbers = np.fromstring(offsets_text.replace(']},":[', ",")[2:-3], dtype=np.int64, sep=",")
    begins, ends = numbers[0::2], numbers[1::2]
    dtype_of = np.fromiter(map(dtype_ids.__getitem__, dtype_names), np.int64, n)
    shape_of = np.fromiter(map(shape_ids.__getitem__, shape_texts), np.int64, n)
    bits = (
        np.array([d.bits for d in dtypes], dtype=np.int64)[dtype_of]
        * np.array(numel, dtype=np.int64)[shape_of]
    )
    if (bits % 8).any() or ((ends - begins) * 8 != bits).any():
        return None
    in_order = (begins[1:] > begins[:-1]) | ((begins[1:] == begins[:-1]) & (ends[1:] >= ends[:-1]))
    order = None if in_order.all() else np.lexsort((ends, begins))
    if order is not None:
        begins, ends, dtype_of, shape_of = (
            begins[order],
            ends[order],
            dtype_of[order],
            shape_of[order],
        )
        names = [names[i] for i in order.tolist()]
    if begins[0] != 0 or (begins[1:] != ends[:-1]).any() or data_start + int(ends[-1]) != file_size:
        return None
    with _gc_paused():
        infos = tuple(
            map(
                functools.partial(tuple.__new__, TensorInfo),
                zip(
                    names,
                    map(dtypes.__getitem__, dtype_of.tolist()),
                    map(shapes.__getitem__, shape_of.tolist()),
                    begins.tolist(),
                    ends.tolist(),
                    strict=True,
                ),
            )
        )
        header = Header(infos, metadata, data_start)
    if len(header._by_name) != n or METADATA_KEY in header:
        return None  # a repeated key, or __metadata__ used as a tensor: the general path says so
    return header
