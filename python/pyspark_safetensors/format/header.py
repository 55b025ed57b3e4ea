"""Header encoding and decoding, with every rule of the reference reader enforced.

Layout: 8-byte little-endian header length N, N bytes of UTF-8 JSON padded with spaces
to a multiple of 8, then the tensors' bytes. Offsets in the header are relative to the
start of the byte buffer (8 + N).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
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
    MetadataError,
    OffsetsError,
    ShapeError,
    SizeMismatchError,
    TruncatedFileError,
    UnknownDTypeError,
)

MAX_HEADER_BYTES = 100_000_000
"""The reference library refuses larger headers; so do we, before reading them."""

METADATA_KEY = "__metadata__"


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
        object.__setattr__(self, "_by_name", {t.name: t for t in self.tensors})

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
    """The spec with plain-int dims and its bytes per tensor; errors name a tensor using it."""
    dtype, shape = spec
    shape = tuple(map(int, shape))
    nbytes = dtype.nbytes(math.prod(shape))
    if any(s < 0 for s in shape) or nbytes is None:
        users = np.flatnonzero(spec_of == index)
        name = names[int(users[0])] if len(users) else None
        if any(s < 0 for s in shape):
            raise ShapeError(f"negative dimension in shape {list(shape)}", tensor=name)
        raise SizeMismatchError(
            f"{dtype} elements of shape {list(shape)} do not end on a byte", tensor=name
        )
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
        raise ValueError(f"{len(names)} names for {len(spec_of)} tensors")
    if metadata is not None:
        _check_metadata(metadata, path=None)
    unique = set(names)
    if len(unique) != len(names):
        seen: set[str] = set()
        duplicate = next(n for n in names if n in seen or seen.add(n))
        raise DuplicateKeyError(f"two tensors are named {duplicate!r}", tensor=duplicate)
    if METADATA_KEY in unique:
        raise ValueError(f"{METADATA_KEY!r} is reserved and cannot name a tensor")
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
    body = ("{" + ",".join(parts) + "}").encode("utf-8")
    body += b" " * (-len(body) % 8)
    return HeaderLayout(
        struct.pack("<Q", len(body)) + body, file_names, specs, file_specs, begins, ends, order
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
    if n > MAX_HEADER_BYTES:
        raise HeaderTooLargeError(f"header length {n} exceeds {MAX_HEADER_BYTES}", path=path)
    if 8 + n > file_size:
        raise TruncatedFileError(
            f"header length {n} runs past the end of the {file_size}-byte file", path=path
        )
    return n


def _no_duplicates(path):
    def hook(pairs):
        obj = {}
        for k, v in pairs:
            if k in obj:
                raise DuplicateKeyError(f"key {k!r} appears twice", path=path, tensor=k)
            obj[k] = v
        return obj

    return hook


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


def _is_uint(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def decode_header(raw: bytes, file_size: int, path: str | None = None) -> Header:
    """Decode and validate a header.

    ``raw`` holds at least the first 8 + N bytes of the file; ``file_size`` is the whole
    file's length. Raises a ``SafetensorsFormatError`` subclass naming the rule broken.
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
    try:
        doc = json.loads(text, object_pairs_hook=_no_duplicates(path))
    except json.JSONDecodeError as e:
        raise HeaderEncodingError(
            f"header is not valid JSON: {e.msg} at char {e.pos}", path=path
        ) from None
    except RecursionError:
        raise HeaderEncodingError("header JSON is nested too deeply", path=path) from None
    if not isinstance(doc, dict):
        raise HeaderStructureError("header JSON is not an object", path=path)

    metadata = doc.pop(METADATA_KEY, None)
    if metadata is not None:
        _check_metadata(metadata, path)

    infos = []
    for name, entry in doc.items():
        infos.append(_decode_entry(name, entry, path))

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
    data_start = 8 + n
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
    if not isinstance(shape, list) or not all(_is_uint(s) for s in shape):
        raise ShapeError(
            f"shape {shape!r} is not a list of non-negative integers", path=path, tensor=name
        )
    offsets = entry["data_offsets"]
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_uint(o) for o in offsets)):
        raise OffsetsError(
            f"data_offsets {offsets!r} is not [begin, end] of non-negative integers",
            path=path,
            tensor=name,
        )
    begin, end = offsets
    if end < begin:
        raise OffsetsError(
            f"data_offsets [{begin}, {end}] end before they begin", path=path, tensor=name
        )
    numel = math.prod(shape)
    nbytes = dtype.nbytes(numel)
    if nbytes != end - begin:
        raise SizeMismatchError(
            f"shape {shape} of {dtype} needs {nbytes if nbytes is not None else 'a fractional number of'} bytes, "
            f"data_offsets [{begin}, {end}] hold {end - begin}",
            path=path,
            tensor=name,
        )
    return TensorInfo(name, dtype, tuple(shape), begin, end)
