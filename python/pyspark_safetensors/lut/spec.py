"""The lookup-table layout (``lut-format-spec``): ``lut/metadata.json`` plus one
``{layer_path}.lut.safetensors`` per linear layer, and ``validate_lut`` which checks every
rule of it.

Besides the spec's linear layers a LUT may hold whole MLP blocks (``kind: "mlp"`` in the
layer's ``metadata.json`` entry and in its file's header): a transcoder of the block
``model.layers.N.mlp`` stored in the spec's names, ``encoder_weight``, ``encoder_bias``,
``precomputed_products`` = the transcoder's decoder rows (the block's output per latent),
``bias_product`` = its decoder bias, plus ``skip_weight [output_dim, input_dim]`` for a
skip transcoder. It has no ``decoder_weight``/``decoder_bias``: a transcoder reconstructs
the block's output, not its input, so there is nothing to compensate from.

A cross-layer transcoder's block (``sources`` in its entry and in its file's header: the
MLP blocks of the same LUT, at or below it and ending with itself, whose codes it is
decoded from) stores its own layer's encoder only, and ``precomputed_products`` of
``len(sources) * num_basis`` rows: the rows of ``W_dec^{l->N}`` of each source in
``sources``' order, so its code is the concatenation of the sources' codes, each computed
by that source's own file from that block's input."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from ..format import SafetensorsFile
from ..format.errors import PysparkSafetensorsError

VERSION = "1.0"
METADATA = "metadata.json"
SUFFIX = ".lut.safetensors"
FLOAT_DTYPES = ("F16", "BF16")
#: key -> shape in terms of (num_basis, input_dim, output_dim)
TENSORS = {
    "encoder_weight": ("num_basis", "input_dim"),
    "encoder_bias": ("num_basis",),
    "decoder_weight": ("num_basis", "input_dim"),
    "decoder_bias": ("input_dim",),
    "precomputed_products": ("num_basis", "output_dim"),
    "bias_product": ("output_dim",),
}
LINEAR, MLP = "linear", "mlp"
KINDS = (LINEAR, MLP)
"""A layer entry's ``kind``: a linear layer (the spec's, the default when absent) or a
whole MLP block replaced by a transcoder."""
MLP_TENSORS = {
    "encoder_weight": ("num_basis", "input_dim"),
    "encoder_bias": ("num_basis",),
    "precomputed_products": ("num_basis", "output_dim"),
    "bias_product": ("output_dim",),
}
"""The tensors of an MLP block's file; a skip transcoder's adds ``SKIP_TENSOR``."""
SKIP_TENSOR = ("skip_weight", ("output_dim", "input_dim"))


class LUTError(PysparkSafetensorsError, ValueError):
    """A LUT directory or file breaks the format, or its inputs do not fit together."""


def layer_file(layer: str) -> str:
    """``{layer_path}.lut.safetensors``; refuses names that would leave ``lut/``."""
    if not layer or "/" in layer or "\\" in layer or layer.startswith(".") or "\0" in layer:
        raise LUTError(f"layer name {layer!r} cannot be a file name inside lut/")
    return layer + SUFFIX


def entry_kind(entry: dict, where: str = "") -> str:
    """A ``metadata.json`` layer entry's kind: ``"linear"`` unless it says ``"mlp"``."""
    kind = entry.get("kind", LINEAR)
    if kind not in KINDS:
        raise LUTError(f"{where}: kind {kind!r}; this reader knows {list(KINDS)}")
    return kind


def file_kind(path: str | os.PathLike) -> str:
    """The kind a ``.lut.safetensors`` file's header records (``"linear"`` when it records
    none, as the spec's files)."""
    with SafetensorsFile(path) as f:
        return (f.metadata or {}).get("kind", LINEAR)


def check_blocks(names) -> None:
    """Refuse a LUT whose linear layers lie inside an MLP block it replaces whole (patched
    in, the block's LUT would leave them unused): ``names`` maps layer -> kind."""
    blocks = [name for name, kind in names.items() if kind == MLP]
    for name in names:
        inside = [b for b in blocks if name.startswith(b + ".")]
        if inside:
            raise LUTError(
                f"layer {name!r} lies inside MLP block {inside[0]!r}, which the LUT replaces "
                "whole; keep one of them"
            )


def check_inside(path: Path, lut_dir: Path) -> None:
    """Refuse a file of ``lut/`` that is not a regular file (a FIFO would block the
    reader, a directory or device is no table) or a symlink leading out of ``lut/``."""
    real = Path(os.path.realpath(path))
    root = Path(os.path.realpath(lut_dir))
    if path.is_symlink() and root not in real.parents:
        raise LUTError(
            f"{path}: a symlink to {real}, outside {lut_dir}; every LUT file must lie in lut/"
        )
    try:
        mode = os.stat(real).st_mode
    except OSError as e:
        raise LUTError(f"{path}: cannot be read ({e.strerror})") from e
    if not stat.S_ISREG(mode):
        raise LUTError(f"{path}: not a regular file; a LUT file must be a plain file")


def _need(doc: dict, key: str, kind, where: str):
    if key not in doc:
        raise LUTError(f"{where}: missing required key {key!r}")
    value = doc[key]
    if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise LUTError(f"{where}: {key!r} must be a positive integer, got {value!r}")
    if kind is not int and not isinstance(value, kind):
        raise LUTError(f"{where}: {key!r} must be a {kind.__name__}, got {type(value).__name__}")
    return value


def validate_lut(lut_dir: str | os.PathLike) -> dict:
    """Check ``metadata.json`` against the spec and every layer file against it (keys,
    shapes, one float16/bfloat16 dtype per file), and that every file is a regular file
    inside ``lut_dir`` (no symlink out of it, no FIFO or directory). An MLP block's entry
    (``kind: "mlp"``) needs ``skip`` and a file of its kind (``MLP_TENSORS``, plus
    ``skip_weight`` when ``skip``); no linear layer may lie inside such a block. Returns the metadata; raises ``LUTError`` naming the file and the rule."""
    lut_dir = Path(lut_dir)
    meta_path = lut_dir / METADATA
    if not os.path.lexists(meta_path):
        raise LUTError(f"{lut_dir}: no {METADATA} (an incomplete or foreign directory)")
    check_inside(meta_path, lut_dir)
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as e:
        raise LUTError(f"{meta_path}: not JSON ({e})") from e
    where = str(meta_path)
    if not isinstance(meta, dict):
        raise LUTError(f"{where}: top level must be an object")
    version = _need(meta, "version", str, where)
    if version != VERSION:
        raise LUTError(f"{where}: version {version!r}, this reader knows {VERSION!r}")
    sae = _need(meta, "sae_config", dict, where)
    num_basis = _need(sae, "num_basis", int, where + " sae_config")
    k_active = _need(sae, "k_active", int, where + " sae_config")
    if k_active > num_basis:
        raise LUTError(f"{where}: k_active {k_active} exceeds num_basis {num_basis}")
    for optional in ("model_config", "creation_info"):
        if optional in meta and not isinstance(meta[optional], dict):
            raise LUTError(f"{where}: {optional!r} must be an object")
    layers = _need(meta, "layers", dict, where)
    if not layers:
        raise LUTError(f"{where}: 'layers' is empty")
    for name, entry in layers.items():
        lw = f"{where} layers[{name!r}]"
        if not isinstance(entry, dict):
            raise LUTError(f"{lw}: must be an object")
        dims = {
            "num_basis": num_basis,
            "input_dim": _need(entry, "input_dim", int, lw),
            "output_dim": _need(entry, "output_dim", int, lw),
        }
        file = _need(entry, "file", str, lw)
        if Path(file).name != file or file in ("", ".", ".."):
            raise LUTError(f"{lw}: file {file!r} is not a plain file name inside lut/")
        if not file.endswith(SUFFIX):
            raise LUTError(f"{lw}: file {file!r} must end with {SUFFIX}")
        path = lut_dir / file
        if not os.path.lexists(path):
            raise LUTError(f"{lw}: file {file} is missing")
        check_inside(path, lut_dir)
        kind = entry_kind(entry, lw)
        if kind == MLP and not isinstance(entry.get("skip"), bool):
            raise LUTError(f"{lw}: an MLP block's entry needs 'skip' (true or false)")
        sources = _sources(layers, name, entry, lw)
        dims["len(sources) * num_basis"] = len(sources) * num_basis
        _check_layer_file(path, dims, kind, entry.get("skip", False), sources)
    check_blocks({name: entry_kind(entry) for name, entry in layers.items()})
    return meta


def _sources(layers: dict, name: str, entry: dict, where: str) -> list[str]:
    """An MLP block's ``sources`` (itself alone when absent), checked: MLP blocks of this
    LUT listed before it, then itself, each once."""
    if entry_kind(entry) != MLP:
        if "sources" in entry:
            raise LUTError(f"{where}: 'sources' belongs to an MLP block's entry")
        return [name]
    sources = entry.get("sources", [name])
    names = list(layers)
    if (
        not isinstance(sources, list)
        or not sources
        or sources[-1] != name
        or len(set(sources)) != len(sources)
        or any(s not in layers or entry_kind(layers[s]) != MLP for s in sources)
        or [s for s in names if s in sources] != sources
    ):
        raise LUTError(
            f"{where}: sources {sources!r} must list MLP blocks of this LUT in its order, "
            f"ending with {name!r}"
        )
    return sources


def _check_layer_file(
    path: Path, dims: dict[str, int], kind: str, skip: bool, sources: list[str]
) -> None:
    with SafetensorsFile(path) as f:
        infos = {i.name: i for i in f.header.tensors}
        recorded = (f.metadata or {}).get("kind", LINEAR)
        recorded_sources = (f.metadata or {}).get("sources")
    if recorded != kind:
        raise LUTError(f"{path}: its header says kind {recorded!r}, metadata.json {kind!r}")
    if len(sources) > 1 and recorded_sources != json.dumps(sources):
        raise LUTError(
            f"{path}: its header's sources {recorded_sources} differ from metadata.json's {sources}"
        )
    want = TENSORS if kind == LINEAR else dict(MLP_TENSORS)
    if kind == MLP:
        want["precomputed_products"] = ("len(sources) * num_basis", "output_dim")
    if kind == MLP and skip:
        want[SKIP_TENSOR[0]] = SKIP_TENSOR[1]
    missing = sorted(set(want) - set(infos))
    extra = sorted(set(infos) - set(want))
    if missing or extra:
        raise LUTError(f"{path}: tensors missing {missing}, unexpected {extra}")
    dtypes = {i.dtype.name for i in infos.values()}
    if not dtypes <= set(FLOAT_DTYPES):
        raise LUTError(f"{path}: dtypes {sorted(dtypes)}; the spec allows float16 or bfloat16")
    if len(dtypes) > 1:
        raise LUTError(f"{path}: mixed dtypes {sorted(dtypes)}; one file uses one dtype")
    for key, symbolic in want.items():
        want_shape = tuple(dims[s] for s in symbolic)
        got = tuple(infos[key].shape)
        if got != want_shape:
            raise LUTError(
                f"{path}: {key} has shape {list(got)}, expected {list(want_shape)} "
                f"({', '.join(symbolic)})"
            )
