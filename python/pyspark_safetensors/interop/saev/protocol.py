"""The saev sharded-activation protocol v1: ``metadata.json``, shard sizing, the six
dataset views and their index transforms. numpy only.

A dump is ``<dump_to>/<HASH>/metadata.json`` plus ``acts000000.bin ...``: raw
little-endian float32, C order ``[img, layer, token, dim]``, ``S = n_imgs_per_shard``
images per shard (protocol §3; §5 leaves ``S`` undefined, we take §3's value).
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np

from ..convert import ConversionError

METADATA = "metadata.json"
SHARDS_JSON = "shards.json"
VIT_FAMILIES = ("clip", "siglip", "dinov2")
MAX_PATCHES_PER_SHARD = 2_400_000
"""The protocol's default shard budget ("~2.4 M": about 10 GiB float32 at d_vit 1024)."""
BUDGET_KEYS = ("max_patches_per_shard", "n_patches_per_shard")
"""The shard budget: its seed name, and the name of the PyPI release 0.1.0."""
REQUIRED_KEYS = (
    "vit_family", "vit_ckpt", "layers", "n_patches_per_img", "cls_token", "d_vit", "n_imgs", "data",
)  # fmt: skip
OPTIONAL_KEYS = ("seed", "dtype", "protocol")
"""``seed`` (the seed's tenth key, absent from some June 2025 dumps); ``dtype`` and
``protocol`` (saev's protocol 1.x files, which also add ``shards.json``)."""
PROTOCOL_2_KEYS = ("d_model", "n_examples", "content_tokens_per_example", "max_tokens_per_shard")

Patches = Literal["cls", "image", "all"]


class DumpError(ConversionError):
    """A saev dump (or the request made of it) that cannot be read: the message names the
    file or key at fault and how to fix it."""


def shard_file(index: int) -> str:
    """``acts{index:06d}.bin`` (protocol §1)."""
    return f"acts{index:06d}.bin"


def metadata_hash(doc: Mapping, *, compact: bool = False) -> str:
    """The hash directory name: ``sha256(json.dumps(metadata, sort_keys=True))`` (protocol
    §1); ``compact=True`` is the variant with ``separators=(",", ":")`` that saev wrote
    from 18 June 2025 on."""
    text = json.dumps(doc, sort_keys=True, separators=(",", ":") if compact else None)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def imgs_per_shard(max_patches_per_shard: int, n_layers: int, n_tokens_per_img: int) -> int:
    """S, the images of one shard: ``floor(budget / (L x T))`` (protocol §3; 0 when one
    image is over the budget)."""
    return max_patches_per_shard // (n_layers * n_tokens_per_img)


@dataclass(frozen=True)
class Metadata:
    """A parsed, checked ``metadata.json``. ``doc`` is the document as read (key order
    kept), so it can be written back byte for byte."""

    vit_family: str
    vit_ckpt: str
    layers: tuple[int, ...]
    n_patches_per_img: int
    """P: image patches per image, the CLS token excluded."""
    cls_token: bool
    d_vit: int
    n_imgs: int
    max_patches_per_shard: int
    """The shard budget, whatever key held it."""
    data: str | dict
    seed: int | None
    doc: dict

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def n_tokens_per_img(self) -> int:
        """T = P + 1 with a CLS token."""
        return self.n_patches_per_img + int(self.cls_token)

    @property
    def n_imgs_per_shard(self) -> int:
        """S = floor(budget / (L x T)) (protocol §3)."""
        return imgs_per_shard(self.max_patches_per_shard, self.n_layers, self.n_tokens_per_img)

    @property
    def shard_shape(self) -> tuple[int, int, int, int]:
        """Every shard's shape on disk when written by saev (the last one padded)."""
        return (self.n_imgs_per_shard, self.n_layers, self.n_tokens_per_img, self.d_vit)

    @property
    def img_nbytes(self) -> int:
        return self.n_layers * self.n_tokens_per_img * self.d_vit * 4

    @property
    def n_shards(self) -> int:
        """Shards holding data: ceil(n_imgs / S)."""
        return -(-self.n_imgs // self.n_imgs_per_shard)

    def imgs_in_shard(self, shard: int) -> int:
        """Images of data in ``shard`` (the last one may hold fewer than S)."""
        return min(self.n_imgs_per_shard, self.n_imgs - shard * self.n_imgs_per_shard)

    def layer_index(self, layer: int) -> int:
        """Position of ViT layer ``layer`` on the layer axis; an error names the valid ones."""
        if not _is_int(layer) or layer not in self.layers:
            raise DumpError(
                f"layer {layer!r} is not in this dump; its layers are {list(self.layers)}"
            )
        return self.layers.index(layer)

    @property
    def hash(self) -> str:
        return metadata_hash(self.doc)


def parse_metadata(doc: object, where: str) -> Metadata:
    """Check a ``metadata.json`` document and return it parsed; a ``DumpError`` names
    ``where`` and the key at fault. Refuses saev's protocol 2.x (renamed keys, pickled
    ``data``, 8-hex hashes) rather than guess at it."""

    def fail(msg: str):
        raise DumpError(f"{where}: {msg}")

    if not isinstance(doc, dict):
        fail("metadata.json must hold a JSON object")
    version = doc.get("protocol")
    if any(k in doc for k in PROTOCOL_2_KEYS) or (
        isinstance(version, str) and not version.startswith("1")
    ):
        fail(
            f"a saev protocol {version or '2.x'} dump (keys such as d_model, n_examples, "
            "max_tokens_per_shard, shards.json): only protocol 1 dumps (vit_family, d_vit, n_imgs, "
            "max_patches_per_shard) are supported"
        )
    budget_keys = [k for k in BUDGET_KEYS if k in doc]
    if len(budget_keys) != 1:
        fail(
            f"needs exactly one shard budget key of {' or '.join(BUDGET_KEYS)}"
            + (f", found {budget_keys}" if budget_keys else "")
        )
    missing = [k for k in REQUIRED_KEYS if k not in doc]
    if missing:
        fail(f"missing key(s) {', '.join(map(repr, missing))}")
    unknown = [k for k in doc if k not in (*REQUIRED_KEYS, *OPTIONAL_KEYS, *BUDGET_KEYS)]
    if unknown:  # protocol §6: new optional keys are minor additions
        warnings.warn(f"{where}: unknown key(s) {unknown} ignored", stacklevel=2)

    for key in ("vit_family", "vit_ckpt"):
        if not isinstance(doc[key], str):
            fail(f"key {key!r} must be a string, got {doc[key]!r}")
    if doc["vit_family"] not in VIT_FAMILIES:
        fail(f"key 'vit_family' is {doc['vit_family']!r}; protocol v1 knows {list(VIT_FAMILIES)}")
    layers = doc["layers"]
    if not isinstance(layers, list) or not layers or not all(_is_int(x) for x in layers):
        fail(f"key 'layers' must be a non-empty list of integers, got {layers!r}")
    if len(set(layers)) != len(layers):
        fail(f"key 'layers' repeats a layer: {layers}")
    for key in ("n_patches_per_img", "d_vit", "n_imgs", budget_keys[0]):
        if not _is_int(doc[key]):
            fail(f"key {key!r} must be an integer, got {doc[key]!r}")
        if doc[key] <= 0:
            fail(f"key {key!r} must be positive, got {doc[key]}")
    if not isinstance(doc["cls_token"], bool):
        fail(f"key 'cls_token' must be true or false, got {doc['cls_token']!r}")
    if "seed" in doc and not _is_int(doc["seed"]):
        fail(f"key 'seed' must be an integer, got {doc['seed']!r}")
    if not isinstance(doc["data"], str | dict):
        fail(f"key 'data' must be a string or an object, got {type(doc['data']).__name__}")
    if doc.get("dtype", "float32") != "float32":
        fail(f"key 'dtype' is {doc['dtype']!r}; protocol v1 shards are float32")
    meta = Metadata(
        vit_family=doc["vit_family"],
        vit_ckpt=doc["vit_ckpt"],
        layers=tuple(layers),
        n_patches_per_img=doc["n_patches_per_img"],
        cls_token=doc["cls_token"],
        d_vit=doc["d_vit"],
        n_imgs=doc["n_imgs"],
        max_patches_per_shard=doc[budget_keys[0]],
        data=doc["data"],
        seed=doc.get("seed"),
        doc=doc,
    )
    if meta.n_imgs_per_shard < 1:
        fail(
            f"key {budget_keys[0]!r} = {meta.max_patches_per_shard} holds no whole image of "
            f"{meta.n_layers} layer(s) x {meta.n_tokens_per_img} tokens; raise it"
        )
    return meta


def new_metadata(
    *,
    vit_family: str,
    vit_ckpt: str,
    layers: list[int] | tuple[int, ...],
    n_patches_per_img: int,
    cls_token: bool,
    d_vit: int,
    seed: int,
    n_imgs: int,
    max_patches_per_shard: int = MAX_PATCHES_PER_SHARD,
    data: str | Mapping | object,
) -> Metadata:
    """The seed's ten keys, in its order, checked. ``data``: a string (kept as given), a
    dict with a ``type`` key, or a dataclass instance (stored as ``asdict`` plus ``type`` =
    its class name, the protocol's recommendation)."""
    import dataclasses

    if dataclasses.is_dataclass(data) and not isinstance(data, type):
        data = {**dataclasses.asdict(data), "type": type(data).__name__}
    elif isinstance(data, Mapping):
        if "type" not in data:
            raise DumpError("data: a dict must carry a 'type' key (the config's class name)")
        data = dict(data)
    elif not isinstance(data, str):
        raise DumpError(f"data: give a string, a dict or a dataclass, not {type(data).__name__}")
    doc = {
        "vit_family": vit_family,
        "vit_ckpt": vit_ckpt,
        "layers": list(layers),
        "n_patches_per_img": n_patches_per_img,
        "cls_token": cls_token,
        "d_vit": d_vit,
        "seed": seed,
        "n_imgs": n_imgs,
        "max_patches_per_shard": max_patches_per_shard,
        "data": data,
    }
    return parse_metadata(json.loads(json.dumps(doc)), "metadata")


@dataclass(frozen=True)
class View:
    """One of the six views of protocol §5.1: which tokens (``cls``, ``image`` patches,
    ``all``) of which layer (a ViT layer in ``layers``, or ``"all"``), in the order
    img >> layer >> token."""

    meta: Metadata
    patches: Patches = "image"
    layer: int | Literal["all"] = "all"

    def __post_init__(self):
        if self.patches not in ("cls", "image", "all"):
            raise DumpError(f"patches={self.patches!r}: choose 'cls', 'image' or 'all'")
        if self.patches == "cls" and not self.meta.cls_token:
            raise DumpError("patches='cls': this dump has no CLS token (cls_token is false)")
        if self.layer != "all":
            self.meta.layer_index(self.layer)

    @property
    def tokens(self) -> np.ndarray:
        """Token-axis positions this view takes from each (image, layer)."""
        first = int(self.meta.cls_token)
        if self.patches == "cls":
            return np.zeros(1, np.int64)
        if self.patches == "image":
            return np.arange(first, first + self.meta.n_patches_per_img, dtype=np.int64)
        return np.arange(self.meta.n_tokens_per_img, dtype=np.int64)

    @property
    def layer_indices(self) -> np.ndarray:
        if self.layer == "all":
            return np.arange(self.meta.n_layers, dtype=np.int64)
        return np.array([self.meta.layer_index(self.layer)], np.int64)

    @property
    def stride_img(self) -> int:
        """Rows per image: 1, L, P, L x P, T or L x T (protocol §5.1)."""
        return len(self.layer_indices) * len(self.tokens)

    def __len__(self) -> int:
        return self.meta.n_imgs * self.stride_img

    def shard_rows(self, shard: int) -> int:
        return self.meta.imgs_in_shard(shard) * self.stride_img

    def locate(self, index) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(global image, layer position, token position) of view rows ``index`` (any
        integer array): protocol §5.2, vectorised."""
        index = np.asarray(index, dtype=np.int64)
        if index.size and (index.min() < 0 or index.max() >= len(self)):
            bad = index[(index < 0) | (index >= len(self))][0]
            raise IndexError(f"row {bad} out of range for a view of {len(self)} rows")
        img, offset = np.divmod(index, self.stride_img)
        layer_pos, token_pos = np.divmod(offset, len(self.tokens))
        return img, self.layer_indices[layer_pos], self.tokens[token_pos]

    def coordinates(self, index) -> dict[str, np.ndarray]:
        """``image``, ``layer`` (the ViT layer), ``token`` (token-axis position) and
        ``patch`` (image patch number, -1 for the CLS token) of view rows ``index``."""
        img, layer_pos, token = self.locate(index)
        patch = token - int(self.meta.cls_token)
        if self.meta.cls_token:
            patch = np.where(token == 0, -1, patch)
        return {
            "image": img,
            "layer": np.asarray(self.meta.layers, np.int64)[layer_pos],
            "token": token,
            "patch": patch,
        }
