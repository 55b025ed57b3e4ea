"""Cross-layer transcoders (and per-layer transcoder sets) of other libraries, read into
our CLT file's layout (``architectures/clt.py``) and written in theirs.

**circuit-tracer, cross-layer** (``load_clt(dir)``): one pair of files per layer l,
``W_enc_{l}.safetensors`` with ``W_enc_{l} [n, d]``, ``b_enc_{l} [n]``, ``b_dec_{l}
[d]`` and, for a JumpReLU CLT, ``threshold_{l} [n]``; ``W_dec_{l}.safetensors`` with
``W_dec_{l} [n, L - l, d]`` (slot j writes layer l + j) -- our ``encoder_weight[l]``,
``encoder_bias[l]``, ``decoder_bias[l]``, ``threshold[l]`` and ``decoder_weight.{l}``
as they are. It encodes ``pre * 1[pre > threshold]`` (without thresholds, ``ReLU(pre)``:
read as thresholds 0, the same values), which is our ``encode_layer(l, x,
rule="threshold")``; it has no top-k and no ``k``, so a top-k use of a file read from
it needs ``load_sae_model(path, k=...)``. Its model width ``d`` is both the input and the
output width: a CLT with ``d_in != d_out`` is refused. A skip path (``W_skip [L, d, d]``)
has no term in our CLT and is refused unless zero. Tied decoders are written untied (the
slot repeated), the same outputs.

**circuit-tracer, per-layer set** (``load_transcoder_set({l: path})``):
``layer_{l}.safetensors`` with ``W_enc [n, d]``, ``W_dec [n, d]``, ``b_enc [n]``,
``b_dec [d]``, ``activation_function.threshold [n]`` (JumpReLU; absent: ReLU) and an
optional ``W_skip [d, d]`` (``x @ W_skip.T``). Read as a CLT whose decoders are the
``l -> l`` ones only (the others zero); written from a CLT whose ``l -> t`` decoders
(t > l) are all zero, refused otherwise (naming the first that is not).

**sparsify, cross-layer** (its ``cross_layer`` training option, ``coalesce_topk =
"none"``): a directory per layer (named by the MLP module, sorted as sparsify sorts its
hook points), each ``cfg.json`` (``transcode``, ``n_targets`` = how many layers from
this one it writes, ``k``, ``d_in``) and ``sae.safetensors`` with ``encoder.weight [n,
d]``, ``encoder.bias [n]`` and per target slot j: ``W_decs.{j} [n, d]``, ``b_decs.{j}
[d]``, ``post_encs.{j} [n]``. Layer t's output is the sum over sources l of ``z_l
W_decs^l.{t-l} + b_decs^l.{t-l}``, the code the top k of ``ReLU(W x + b)`` -- ours,
with ``decoder_bias[t] = sum_l b_decs^l.{t-l}`` (summed in float64) and slots past a
source's ``n_targets`` zero. ``post_encs.{j}`` (added to each *selected* latent's value
before decoding slot j) is not a function of the value alone, so a non-zero one is
refused, as are ``divide_cross_layer``, ``normalize_io``, ``post_encoder_scale``,
``skip_connection`` and any ``coalesce_topk`` but "none" (each changes the outputs in a
way our CLT has no term for). Written with ``n_targets = L - l``, ``b_decs.0 = b_dec^l``
and the other ``b_decs`` and every ``post_encs`` zero: the same outputs exactly.

Every tensor is checked against the shape the layout implies; a misfit is refused
naming the file, the tensor, its shape and the shape expected.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch

from ..dataset.publish import publishing
from ..format import SafetensorsFile, write_shard
from .checkpoint import CheckpointError

#: Layouts ``export_sae`` writes a CLT in (besides sparsify's).
CIRCUIT_TRACER, CIRCUIT_TRACER_SET, SPARSIFY = (
    "circuit-tracer",
    "circuit-tracer-transcoders",
    "sparsify",
)
#: circuit-tracer's config (JSON, which its YAML reader reads) next to the exported files.
CT_CONFIG = "config.yaml"
#: circuit-tracer's nnsight hook names of a Llama-style MLP's input and output (its
#: ``tl_nnsight_mapping``): ``post_attention_layernorm``'s output and the MLP's output.
CT_INPUT_HOOK, CT_OUTPUT_HOOK = "mlp.hook_in", "mlp.hook_out"


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        with SafetensorsFile(path) as f:
            names = list(f.keys())
            return {n: torch.from_numpy(np.array(f.tensor(n), dtype=np.float32)) for n in names}
    except OSError as e:
        raise CheckpointError(f"{path}: unreadable ({e})") from e


def _take(path: Path, raw: dict, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """``raw[name]``, refused unless present with ``shape``."""
    if name not in raw:
        raise CheckpointError(f"{path}: missing tensor {name} (expected shape {list(shape)})")
    if tuple(raw[name].shape) != tuple(shape):
        raise CheckpointError(
            f"{path}: {name} has shape {list(raw[name].shape)}, expected {list(shape)}"
        )
    return raw[name]


def _zero_or_refuse(path: Path, name: str, t: torch.Tensor, why: str) -> None:
    if bool(t.any()):
        raise CheckpointError(f"{path}: {name} is not zero: {why}")


def _metadata(n_layers, n, d_in, d_out, k, blocks, source) -> dict:
    """Our CLT metadata for a file read from another layout."""
    return {
        "architecture": "clt", "activation": "topk", "k": "" if k is None else str(k),
        "n_layers": str(n_layers), "d_in": str(d_in), "d_out": str(d_out),
        "n_latents": str(n), "tied_decoders": "false",
        "hook_points": json.dumps([f"{b}:input" for b in blocks]),
        "target_hook_points": json.dumps([f"{b}:output" for b in blocks]),
        "blocks": json.dumps(list(blocks)), "source_layout": source,
    }  # fmt: skip


# --- detection ---------------------------------------------------------------------------


def detect(path: Path) -> str | None:
    """The other library's layout of the directory ``path``, or None."""
    if (path / "W_enc_0.safetensors").is_file():
        return CIRCUIT_TRACER
    if (path / "layer_0.safetensors").is_file():
        return CIRCUIT_TRACER_SET
    if _sparsify_layers(path):
        return SPARSIFY
    return None


def _sparsify_layers(path: Path) -> list[Path]:
    """sparsify's per-layer directories of a cross-layer run (``n_targets > 0``), sorted
    as sparsify sorts hook points (numbers by value)."""
    found = []
    for sub in path.iterdir() if path.is_dir() else ():
        cfg = sub / "cfg.json"
        if cfg.is_file() and (sub / "sae.safetensors").is_file():
            try:
                if int(json.loads(cfg.read_text()).get("n_targets", 0)) > 0:
                    found.append(sub)
            except (ValueError, TypeError, AttributeError):
                continue
    key = [lambda p: [int(s) if s.isdigit() else s for s in re.split(r"(\d+)", p.name)]]
    return sorted(found, key=key[0])


# --- reading -------------------------------------------------------------------------------


def read_clt(path: Path, layout: str) -> tuple[dict[str, torch.Tensor], dict]:
    """``(tensors in our CLT file's names, info)`` of the directory ``path`` in
    ``layout`` (``detect``); ``info`` as ``ecosystem.read_sae`` gives it."""
    reader = {CIRCUIT_TRACER: _read_ct, CIRCUIT_TRACER_SET: _read_ct_set, SPARSIFY: _read_sparsify}
    tensors, meta, config = reader[layout](path)
    k = int(meta["k"]) if meta["k"] else None
    return tensors, {"layout": layout, "architecture": "clt", "k": k, "metadata": meta,
                     "config": config}  # fmt: skip


def _ct_config(path: Path) -> dict:
    try:
        cfg = json.loads((path / CT_CONFIG).read_text())
    except (OSError, ValueError):
        return {}  # the files alone are a valid circuit-tracer CLT; a YAML we did not write
    return cfg if isinstance(cfg, dict) else {}


def _blocks(cfg: dict, n_layers: int) -> list[str]:
    blocks = cfg.get("blocks")
    if isinstance(blocks, list) and len(blocks) == n_layers:
        return [str(b) for b in blocks]
    return [f"layers.{layer}.mlp" for layer in range(n_layers)]


def _read_ct(path: Path) -> tuple[dict, dict, dict]:
    n_layers = 0
    while (path / f"W_enc_{n_layers}.safetensors").is_file():
        n_layers += 1
    first = path / "W_enc_0.safetensors"
    raw0 = _tensors(first)
    if "W_enc_0" not in raw0 or raw0["W_enc_0"].ndim != 2:
        raise CheckpointError(f"{first}: missing tensor W_enc_0 [n, d]")
    n, d = raw0["W_enc_0"].shape
    thresholded = "threshold_0" in raw0
    enc_w, enc_b, dec_b, thr, t = [], [], [], [], {}
    for layer in range(n_layers):
        f = path / f"W_enc_{layer}.safetensors"
        raw = raw0 if layer == 0 else _tensors(f)
        enc_w.append(_take(f, raw, f"W_enc_{layer}", (n, d)))
        enc_b.append(_take(f, raw, f"b_enc_{layer}", (n,)))
        dec_b.append(_take(f, raw, f"b_dec_{layer}", (d,)))
        thr.append(_take(f, raw, f"threshold_{layer}", (n,)) if thresholded else torch.zeros(n))
        f = path / f"W_dec_{layer}.safetensors"
        if not f.is_file():
            raise CheckpointError(f"{f}: missing (layer {layer}'s decoder, W_dec_{layer})")
        t[f"decoder_weight.{layer}"] = _take(f, _tensors(f), f"W_dec_{layer}",
                                             (n, n_layers - layer, d))  # fmt: skip
        if "W_skip" in raw:
            _zero_or_refuse(f, "W_skip", raw["W_skip"], "our CLT has no skip path")
    t |= {"encoder_weight": torch.stack(enc_w), "encoder_bias": torch.stack(enc_b),
          "decoder_bias": torch.stack(dec_b), "threshold": torch.stack(thr)}  # fmt: skip
    cfg = _ct_config(path)
    k = cfg.get("k") if isinstance(cfg.get("k"), int) else None
    return t, _metadata(n_layers, n, d, d, k, _blocks(cfg, n_layers), CIRCUIT_TRACER), cfg


def _read_ct_set(path: Path) -> tuple[dict, dict, dict]:
    n_layers = 0
    while (path / f"layer_{n_layers}.safetensors").is_file():
        n_layers += 1
    first = _tensors(path / "layer_0.safetensors")
    if "W_enc" not in first or first["W_enc"].ndim != 2:
        raise CheckpointError(f"{path / 'layer_0.safetensors'}: missing tensor W_enc [n, d]")
    n, d = first["W_enc"].shape
    parts: dict[str, list] = {"encoder_weight": [], "encoder_bias": [], "decoder_bias": [],
                              "threshold": []}  # fmt: skip
    t = {}
    for layer in range(n_layers):
        f = path / f"layer_{layer}.safetensors"
        raw = first if layer == 0 else _tensors(f)
        parts["encoder_weight"].append(_take(f, raw, "W_enc", (n, d)))
        parts["encoder_bias"].append(_take(f, raw, "b_enc", (n,)))
        parts["decoder_bias"].append(_take(f, raw, "b_dec", (d,)))
        name = "activation_function.threshold"
        parts["threshold"].append(_take(f, raw, name, (n,)) if name in raw else torch.zeros(n))
        w_dec = _take(f, raw, "W_dec", (n, d))
        if "W_skip" in raw:
            _zero_or_refuse(f, "W_skip", raw["W_skip"], "our CLT has no skip path")
        slots = torch.zeros(n, n_layers - layer, d)
        slots[:, 0] = w_dec  # a per-layer set: only the l -> l decoder
        t[f"decoder_weight.{layer}"] = slots
    t |= {name: torch.stack(v) for name, v in parts.items()}
    cfg = _ct_config(path)
    k = cfg.get("k") if isinstance(cfg.get("k"), int) else None
    return t, _metadata(n_layers, n, d, d, k, _blocks(cfg, n_layers), CIRCUIT_TRACER_SET), cfg


_SPARSIFY_REFUSED = {
    "divide_cross_layer": (False, "it divides the earlier layers' outputs by their number"),
    "normalize_io": (False, "it rescales inputs and outputs outside the weights"),
    "post_encoder_scale": (False, "it scales each selected latent per target"),
    "skip_connection": (False, "our CLT has no skip path"),
    "coalesce_topk": ("none", "it selects the top k over several layers' latents at once"),
    "transcode": (True, "a cross-layer autoencoder is not a transcoder"),
}


def _read_sparsify(path: Path) -> tuple[dict, dict, dict]:
    layers = _sparsify_layers(path)
    cfgs = [json.loads((sub / "cfg.json").read_text()) for sub in layers]
    for sub, cfg in zip(layers, cfgs, strict=True):
        for key, (want, why) in _SPARSIFY_REFUSED.items():
            if cfg.get(key, want) != want:
                raise CheckpointError(f"{sub / 'cfg.json'}: {key} = {cfg[key]!r}: {why}")
    n_layers, d = len(layers), int(cfgs[0]["d_in"])
    ks = {int(cfg["k"]) for cfg in cfgs}
    if len(ks) != 1:
        raise CheckpointError(f"{path}: the layers' k differ ({sorted(ks)}); ours has one k")
    raw0 = _tensors(layers[0] / "sae.safetensors")
    n = raw0["encoder.weight"].shape[0] if "encoder.weight" in raw0 else int(cfgs[0]["num_latents"])
    t, enc_w, enc_b = {}, [], []
    bias = torch.zeros(n_layers, d, dtype=torch.float64)
    for layer, (sub, cfg) in enumerate(zip(layers, cfgs, strict=True)):
        f = sub / "sae.safetensors"
        raw = raw0 if layer == 0 else _tensors(f)
        if int(cfg["d_in"]) != d:
            raise CheckpointError(f"{sub / 'cfg.json'}: d_in {cfg['d_in']}, the first layer's {d}")
        enc_w.append(_take(f, raw, "encoder.weight", (n, d)))
        enc_b.append(_take(f, raw, "encoder.bias", (n,)))
        slots = torch.zeros(n, n_layers - layer, d)
        n_targets = int(cfg["n_targets"])
        if n_targets > n_layers - layer:
            raise CheckpointError(
                f"{sub / 'cfg.json'}: n_targets {n_targets} from layer {layer} of {n_layers}"
            )
        for j in range(n_targets):
            slots[:, j] = _take(f, raw, f"W_decs.{j}", (n, d))
            bias[layer + j] += _take(f, raw, f"b_decs.{j}", (d,)).double()
            if f"post_encs.{j}" in raw:
                _zero_or_refuse(f, f"post_encs.{j}", _take(f, raw, f"post_encs.{j}", (n,)),
                                "sparsify adds it to each selected latent before decoding, "
                                "which our decoders cannot express (train with "
                                "train_post_encoder=false)")  # fmt: skip
        t[f"decoder_weight.{layer}"] = slots
    t |= {"encoder_weight": torch.stack(enc_w), "encoder_bias": torch.stack(enc_b),
          "decoder_bias": bias.float(), "threshold": torch.zeros(n_layers, n)}  # fmt: skip
    meta = _metadata(n_layers, n, d, d, ks.pop(), [sub.name for sub in layers], SPARSIFY)
    return t, meta, {sub.name: cfg for sub, cfg in zip(layers, cfgs, strict=True)}


# --- writing ---------------------------------------------------------------------------------


def export_clt(tensors: dict[str, torch.Tensor], meta: dict, out_dir: Path, layout: str,
               *, k: int | None = None) -> Path:  # fmt: skip
    """Write our CLT (``tensors`` and ``meta`` as ``read_sae`` gives them) in ``layout``
    (``CIRCUIT_TRACER``, ``CIRCUIT_TRACER_SET`` or ``SPARSIFY``), whole or not at all."""
    n_layers, _, d_in = tensors["encoder_weight"].shape
    d_out = tensors["decoder_bias"].shape[1]
    if d_in != d_out:
        raise CheckpointError(
            f"a CLT from {d_in} to {d_out} dimensions; {layout}'s coders have one width "
            "(the model's), so it cannot store this one"
        )
    decoders = [_untied(tensors[f"decoder_weight.{layer}"], n_layers - layer)
                for layer in range(n_layers)]  # fmt: skip
    blocks = json.loads(meta.get("blocks") or "[]") or [f"layers.{i}.mlp" for i in range(n_layers)]
    k = k or (int(meta["k"]) if meta.get("k") else None)
    writer = {CIRCUIT_TRACER: _write_ct, CIRCUIT_TRACER_SET: _write_ct_set,
              SPARSIFY: _write_sparsify}  # fmt: skip
    out = Path(out_dir)
    with publishing(out) as tmp:
        writer[layout](tmp, tensors, decoders, blocks, k)
    return out


def _untied(w: torch.Tensor, slots: int) -> torch.Tensor:
    """A decoder ``[n, S, d]`` with one slot per target (a tied one's slot repeated)."""
    return w.expand(-1, slots, -1) if w.shape[1] == 1 else w


def _np(t: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(t.detach().to(torch.float32).numpy())


def _ct_doc(kind: str, blocks: list[str], k: int | None, files: list[str] | None) -> str:
    doc = {"model_kind": kind, "feature_input_hook": CT_INPUT_HOOK,
           "feature_output_hook": CT_OUTPUT_HOOK, "blocks": blocks, "k": k}  # fmt: skip
    if files is not None:
        doc["transcoders"] = files
    return json.dumps(doc, indent=2) + "\n"


def _write_ct(tmp: Path, t: dict, decoders: list, blocks: list[str], k) -> None:
    for layer, w in enumerate(decoders):
        write_shard(tmp / f"W_enc_{layer}.safetensors", {
            f"W_enc_{layer}": _np(t["encoder_weight"][layer]),
            f"b_enc_{layer}": _np(t["encoder_bias"][layer]),
            f"b_dec_{layer}": _np(t["decoder_bias"][layer]),
            f"threshold_{layer}": _np(t["threshold"][layer]),
        }, {"format": "pt"})  # fmt: skip
        write_shard(tmp / f"W_dec_{layer}.safetensors", {f"W_dec_{layer}": _np(w)},
                    {"format": "pt"})  # fmt: skip
    (tmp / CT_CONFIG).write_text(_ct_doc("cross_layer_transcoder", blocks, k, None))


def _write_ct_set(tmp: Path, t: dict, decoders: list, blocks: list[str], k) -> None:
    for layer, w in enumerate(decoders):
        for j in range(1, w.shape[1]):
            _zero_or_refuse(Path(f"decoder_weight.{layer}"), f"slot {j} (layer {layer} -> "
                            f"{layer + j})", w[:, j], "a per-layer transcoder set has only "
                            "l -> l decoders; write it as a CLT")  # fmt: skip
    for layer, w in enumerate(decoders):
        write_shard(tmp / f"layer_{layer}.safetensors", {
            "W_enc": _np(t["encoder_weight"][layer]), "W_dec": _np(w[:, 0]),
            "b_enc": _np(t["encoder_bias"][layer]), "b_dec": _np(t["decoder_bias"][layer]),
            "activation_function.threshold": _np(t["threshold"][layer]),
        }, {"format": "pt"})  # fmt: skip
    files = [f"layer_{layer}.safetensors" for layer in range(len(decoders))]
    (tmp / CT_CONFIG).write_text(_ct_doc("transcoder_set", blocks, k, files))


def _write_sparsify(tmp: Path, t: dict, decoders: list, blocks: list[str], k) -> None:
    if k is None:
        raise CheckpointError("the CLT records no k; pass k= (sparsify's coders keep the top k)")
    n_layers, n, d = t["encoder_weight"].shape
    for layer, w in enumerate(decoders):
        slots = n_layers - layer
        weights = {"encoder.weight": _np(t["encoder_weight"][layer]),
                   "encoder.bias": _np(t["encoder_bias"][layer])}  # fmt: skip
        for j in range(slots):
            weights[f"W_decs.{j}"] = _np(w[:, j])
            bias = t["decoder_bias"][layer] if j == 0 else torch.zeros(d)
            weights[f"b_decs.{j}"] = _np(bias)  # each target's bias once, from its own layer
            weights[f"post_encs.{j}"] = np.zeros(n, np.float32)
        cfg = {
            "activation": "topk", "expansion_factor": max(1, n // d), "normalize_decoder": True,
            "num_latents": n, "k": k, "multi_topk": False, "skip_connection": False,
            "transcode": True, "n_targets": slots, "n_sources": layer + 1,
            "normalize_io": False, "divide_cross_layer": False, "train_post_encoder": False,
            "post_encoder_scale": False, "coalesce_topk": "none", "topk_coalesced": True,
            "d_in": d,
        }  # fmt: skip
        sub = tmp / blocks[layer]
        sub.mkdir()
        write_shard(sub / "sae.safetensors", weights, {"format": "pt"})
        (sub / "cfg.json").write_text(json.dumps(cfg, indent=2) + "\n")
