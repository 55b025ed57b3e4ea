"""Header encoding and decoding, with every rule of the reference reader enforced.

Layout: 8-byte little-endian header length N, N bytes of UTF-8 JSON padded with spaces
to a multiple of 8, then the tensors' bytes. Offsets in the header are relative to the
start of the byte buffer (8 + N).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from json.encoder import encode_basestring
from typing import NamedTuple

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


def layout_order(entries: Iterable[tuple[str, DType]]) -> list[str]:
    """Names in the order the reference library lays tensors out: dtype rank descending
    (widest first, so every tensor is aligned), then name."""
    by_rank: dict[int, list[str]] = {}
    for name, dtype in entries:
        by_rank.setdefault(dtype.rank, []).append(name)
    return [name for rank in sorted(by_rank, reverse=True) for name in sorted(by_rank[rank])]


def encode_header(
    tensors: Mapping[str, tuple[DType, tuple[int, ...]]],
    metadata: Mapping[str, str] | None = None,
) -> tuple[bytes, list[TensorInfo]]:
    """Encode a header for ``{name: (dtype, shape)}``.

    Returns the bytes to write before the data (length prefix + padded JSON) and the
    tensor entries in the order their bytes must follow. For the same tensors and at most
    one metadata key, the bytes equal ``safetensors.torch.save``'s; metadata keys are
    written sorted (the reference writes them in hash-map order, which varies by process).
    """
    if METADATA_KEY in tensors:
        raise ValueError(f"{METADATA_KEY!r} is reserved and cannot name a tensor")
    if metadata is not None:
        _check_metadata(metadata, path=None)
    infos: list[TensorInfo] = []
    parts: list[str] = []
    if metadata is not None:
        items = ",".join(
            f"{encode_basestring(k)}:{encode_basestring(metadata[k])}" for k in sorted(metadata)
        )
        parts.append(f'"{METADATA_KEY}":{{{items}}}')
    offset = 0
    sizes: dict[tuple, tuple[int, str]] = {}  # (dtype, shape) -> (nbytes, dims); KV shapes repeat
    for name in layout_order((n, d) for n, (d, _) in tensors.items()):
        dtype, shape = tensors[name]
        shape = tuple(shape)
        known = sizes.get((dtype, shape))
        if known is None:
            shape = tuple(map(int, shape))
            if any(s < 0 for s in shape):
                raise ShapeError(f"negative dimension in shape {list(shape)}", tensor=name)
            nbytes = dtype.nbytes(math.prod(shape))
            if nbytes is None:
                raise SizeMismatchError(
                    f"{dtype} elements of shape {list(shape)} do not end on a byte", tensor=name
                )
            known = sizes[(dtype, shape)] = (nbytes, ",".join(map(str, shape)))
        nbytes, dims = known
        end = offset + nbytes
        infos.append(TensorInfo(name, dtype, shape, offset, end))
        parts.append(
            f'{encode_basestring(name)}:{{"dtype":"{dtype.name}","shape":[{dims}],"data_offsets":[{offset},{end}]}}'
        )
        offset = end
    # The reference writes compact serde_json: same separators, non-ASCII kept as UTF-8.
    body = ("{" + ",".join(parts) + "}").encode("utf-8")
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body, infos


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
