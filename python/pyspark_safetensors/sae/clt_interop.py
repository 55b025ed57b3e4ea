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
(t > l) are all zero, refused otherwise (naming the first that is not), or from per-layer
transcoders (``export_transcoder_set``). One such file alone (``read_ct_transcoder``) is a
transcoder, its ``W_skip`` our skip transcoder's ``skip_weight`` as it is: what the
replacement model reads a set as, file by file (``transcoder_set_files``).

**circuit-tracer's config** (``config.yaml`` beside the files, YAML; the files alone are
a whole dictionary): ``model_kind``, ``feature_input_hook`` and ``feature_output_hook``
(per-layer hook names, ``blocks.{l}.{hook}`` in TransformerLens's terms: ``mlp.hook_in``
is the MLP's input, ``hook_resid_mid`` the residual stream before its norm), an optional
``transcoders`` list (a set's files in layer order; an ``hf://`` one is taken as the file
of its name in the directory) and ``scan``. Read as the hook points ``blocks.{l}.{hook}``,
which ``block_of`` resolves against a model; ours adds ``blocks``, ``k`` and
``threshold_source``. Without a config no hook point is recorded: the dictionary's layers
are the model's blocks in order.

**Thresholds.** circuit-tracer encodes with the thresholds a file holds, or with a ReLU
(thresholds 0, exactly the same): thresholds read from it are the peer's
(``threshold_source = "peer"``, unless our config recorded another). It has no top-k, so a
dictionary without thresholds (a top-k one: no ``threshold_source``) is not written in its
layouts: circuit-tracer would fire every positive pre-activation.

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
from .architectures.clt import THRESHOLD_SOURCE, THRESHOLD_SOURCES
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
#: A circuit-tracer per-layer transcoder file's tensors (``SingleLayerTranscoder.
#: to_safetensors``) and their names here; ``W_skip`` is optional.
CT_TRANSCODER = {"W_enc": "encoder_weight", "b_enc": "encoder_bias", "W_dec": "decoder_weight",
                 "b_dec": "decoder_bias"}  # fmt: skip
CT_THRESHOLD = "activation_function.threshold"


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


def _metadata(n_layers, n, d_in, d_out, k, hooks, source, thresholds=None) -> dict:
    """Our CLT metadata for a file read from another layout: ``hooks`` = ``(input hook
    points, target hook points)`` (empty: none recorded), ``thresholds`` its
    ``threshold_source`` (None: it holds none)."""
    from .architectures.clt import block_of

    inputs, targets = hooks
    return {
        "architecture": "clt", "activation": "topk", "k": "" if k is None else str(k),
        "n_layers": str(n_layers), "d_in": str(d_in), "d_out": str(d_out),
        "n_latents": str(n), "tied_decoders": "false",
        "hook_points": json.dumps(list(inputs)), "target_hook_points": json.dumps(list(targets)),
        "blocks": json.dumps([block_of(h) for h in inputs]), "source_layout": source,
    } | ({THRESHOLD_SOURCE: thresholds} if thresholds else {})  # fmt: skip


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
    return sorted(found, key=lambda p: _natural(p.name))


def _natural(name: str) -> list:
    """Sort key of a hook point as sparsify sorts them (numbers by value)."""
    return [int(s) if s.isdigit() else s for s in re.split(r"(\d+)", name)]


# --- reading -------------------------------------------------------------------------------


def read_clt(path: Path, layout: str) -> tuple[dict[str, torch.Tensor], dict]:
    """``(tensors in our CLT file's names, info)`` of the directory ``path`` in
    ``layout`` (``detect``); ``info`` as ``ecosystem.read_sae`` gives it."""
    reader = {CIRCUIT_TRACER: _read_ct, CIRCUIT_TRACER_SET: _read_ct_set, SPARSIFY: _read_sparsify}
    tensors, meta, config = reader[layout](path)
    k = int(meta["k"]) if meta["k"] else None
    return tensors, {"layout": layout, "architecture": "clt", "k": k, "metadata": meta,
                     "config": config}  # fmt: skip


def ct_config(path: Path) -> dict:
    """circuit-tracer's ``config.yaml`` in the directory ``path`` ({} when there is none:
    the files alone are a whole dictionary); refused when present but unreadable."""
    f = Path(path) / CT_CONFIG
    if not f.is_file():
        return {}
    text = f.read_text()
    try:
        import yaml  # circuit-tracer's own reader (huggingface_hub's dependency)
    except ImportError:  # JSON, which ours writes, is YAML too
        yaml = None
    errors = (ValueError,) if yaml is None else (ValueError, yaml.YAMLError)
    try:
        cfg = json.loads(text) if yaml is None else yaml.safe_load(text)
    except errors as e:
        raise CheckpointError(f"{f}: unreadable ({e})") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{f}: not a mapping of settings")
    return cfg


def _hooks(cfg: dict, n_layers: int) -> tuple[list[str], list[str]]:
    """The hook points a circuit-tracer config records, per layer: ours (``blocks``), else
    its ``blocks.{l}.{feature_input_hook}`` and ``...{feature_output_hook}``; none without
    a config."""
    blocks = cfg.get("blocks")
    if isinstance(blocks, list) and len(blocks) == n_layers:
        return [f"{b}:input" for b in blocks], [f"{b}:output" for b in blocks]
    hook_in, hook_out = cfg.get("feature_input_hook"), cfg.get("feature_output_hook")
    if not hook_in:
        return [], []
    inputs = [f"blocks.{layer}.{hook_in}" for layer in range(n_layers)]
    targets = [f"blocks.{layer}.{hook_out}" for layer in range(n_layers)] if hook_out else []
    return inputs, targets


def _ct_thresholds(cfg: dict) -> str:
    """How a circuit-tracer file's thresholds were set: what our config recorded, else
    "peer" (the library's own JumpReLU, or its ReLU read as thresholds 0)."""
    recorded = cfg.get(THRESHOLD_SOURCE)
    return recorded if recorded in THRESHOLD_SOURCES else "peer"


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
    cfg = ct_config(path)
    k = cfg.get("k") if isinstance(cfg.get("k"), int) else None
    meta = _metadata(n_layers, n, d, d, k, _hooks(cfg, n_layers), CIRCUIT_TRACER,
                     _ct_thresholds(cfg))  # fmt: skip
    return t, meta, cfg


def is_ct_transcoder(path: Path) -> bool:
    """Whether the file ``path`` is a circuit-tracer per-layer transcoder (its tensor
    names, and none of ours)."""
    try:
        with SafetensorsFile(path) as f:
            names = set(f.keys())
    except OSError:
        return False
    return set(CT_TRANSCODER) <= names and "encoder_weight" not in names


def read_ct_transcoder(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """``(tensors in our transcoder's names, info)`` of one circuit-tracer per-layer
    transcoder file (``SingleLayerTranscoder.to_safetensors``): ``W_enc [n, d]`` as our
    ``encoder_weight``, ``W_dec [n, d]``, ``b_enc``, ``b_dec`` as they are, its
    ``activation_function.threshold`` as ``threshold`` (a ReLU transcoder's: zeros, the
    same code) and ``W_skip [d, d]`` (applied ``x @ W_skip.T``) as ``skip_weight``. No
    ``k``: it encodes with its thresholds."""
    path = Path(path)
    raw = _tensors(path)
    if "W_enc" not in raw or raw["W_enc"].ndim != 2:
        raise CheckpointError(f"{path}: missing tensor W_enc [n, d]")
    n, d = raw["W_enc"].shape
    t = {ours: _take(path, raw, theirs, shape) for (theirs, ours), shape in
         zip(CT_TRANSCODER.items(), ((n, d), (n,), (n, d), (d,)), strict=True)}  # fmt: skip
    relu = CT_THRESHOLD not in raw
    t["threshold"] = torch.zeros(n) if relu else _take(path, raw, CT_THRESHOLD, (n,))
    if "W_skip" in raw:
        t["skip_weight"] = _take(path, raw, "W_skip", (d, d))
    meta = {"architecture": "skip_transcoder" if "W_skip" in raw else "transcoder",
            "activation": "relu" if relu else "jumprelu", "source_layout": CT_TRANSCODER_FILE,
            THRESHOLD_SOURCE: "peer"}  # fmt: skip
    return t, {"layout": CT_TRANSCODER_FILE, "architecture": meta["architecture"], "k": None,
               "metadata": meta}  # fmt: skip


#: ``read_sae``'s layout name of one circuit-tracer per-layer transcoder file.
CT_TRANSCODER_FILE = "circuit-tracer-transcoder"


def transcoder_set_files(path: Path) -> tuple[list[Path], tuple[list[str], list[str]], dict]:
    """A circuit-tracer transcoder set's files in layer order (its config's
    ``transcoders``, an ``hf://`` entry taken as the file of its name here, else
    ``layer_{l}.safetensors``), the hook points its config records (``_hooks``) and the
    config, with our additions overriding the hook names."""
    path = Path(path)
    cfg = ct_config(path)
    listed = cfg.get("transcoders")
    if isinstance(listed, list) and listed:
        files = [path / Path(str(entry).split("hf://", 1)[-1]).name if str(entry).startswith("hf://")
                 else path / str(entry) for entry in listed]  # fmt: skip
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{path / CT_CONFIG}: transcoders {missing} are not files here")
    else:
        files, layer = [], 0
        while (path / f"layer_{layer}.safetensors").is_file():
            files.append(path / f"layer_{layer}.safetensors")
            layer += 1
    if not files:
        raise CheckpointError(f"{path}: no layer_0.safetensors (a circuit-tracer transcoder set)")
    return files, _hooks(cfg, len(files)), cfg


def _read_ct_set(path: Path) -> tuple[dict, dict, dict]:
    files, hooks, cfg = transcoder_set_files(path)
    layers = [read_ct_transcoder(f)[0] for f in files]
    n, d = layers[0]["encoder_weight"].shape
    n_layers = len(layers)
    t = {}
    for layer, (f, tc) in enumerate(zip(files, layers, strict=True)):
        for name, shape in (("encoder_weight", (n, d)), ("decoder_weight", (n, d))):
            _take(f, tc, name, shape)  # every layer as wide as the first
        if "skip_weight" in tc:
            _zero_or_refuse(f, "W_skip", tc["skip_weight"], "our CLT has no skip path (the "
                            "replacement model reads the set file by file, skip paths "
                            "included: load_replacement)")  # fmt: skip
        slots = torch.zeros(n, n_layers - layer, d)
        slots[:, 0] = tc["decoder_weight"]  # a per-layer set: only the l -> l decoder
        t[f"decoder_weight.{layer}"] = slots
    for name in ("encoder_weight", "encoder_bias", "decoder_bias", "threshold"):
        t[name] = torch.stack([tc[name] for tc in layers])
    k = cfg.get("k") if isinstance(cfg.get("k"), int) else None
    meta = _metadata(n_layers, n, d, d, k, hooks, CIRCUIT_TRACER_SET, _ct_thresholds(cfg))
    return t, meta, cfg


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
    names = [sub.name for sub in layers]  # sparsify's hook points, its modules' names
    hooks = [f"{b}:input" for b in names], [f"{b}:output" for b in names]
    meta = _metadata(n_layers, n, d, d, ks.pop(), hooks, SPARSIFY)  # top-k: no thresholds
    return t, meta, {sub.name: cfg for sub, cfg in zip(layers, cfgs, strict=True)}


# --- writing ---------------------------------------------------------------------------------


def _needs_thresholds(what: str, thresholds: str | None) -> None:
    """Refuse writing a dictionary without thresholds in circuit-tracer's layouts."""
    if thresholds is None:
        raise CheckpointError(
            f"{what} holds no JumpReLU thresholds (no threshold_source: it keeps the top k per "
            "row), and circuit-tracer encodes with a file's thresholds or, without them, a ReLU "
            "(every positive pre-activation): its latents would not be ours. Give it thresholds "
            "first (a CLT trained here has them calibrated at every checkpoint; "
            "CrossLayerTranscoder.calibrate_thresholds on training rows sets them), or export "
            "it to sparsify, which keeps the top k"
        )


def export_clt(tensors: dict[str, torch.Tensor], meta: dict, out_dir: Path, layout: str,
               *, k: int | None = None, thresholds: str | None = None) -> Path:  # fmt: skip
    """Write our CLT (``tensors`` and ``meta`` as ``read_sae`` gives them, ``thresholds``
    its ``threshold_source``) in ``layout`` (``CIRCUIT_TRACER``, ``CIRCUIT_TRACER_SET`` or
    ``SPARSIFY``), whole or not at all; circuit-tracer's layouts only with thresholds."""
    n_layers, _, d_in = tensors["encoder_weight"].shape
    d_out = tensors["decoder_bias"].shape[1]
    if d_in != d_out:
        raise CheckpointError(
            f"a CLT from {d_in} to {d_out} dimensions; {layout}'s coders have one width "
            "(the model's), so it cannot store this one"
        )
    if layout != SPARSIFY:
        _needs_thresholds("the CLT", thresholds)
    decoders = [_untied(tensors[f"decoder_weight.{layer}"], n_layers - layer)
                for layer in range(n_layers)]  # fmt: skip
    blocks = json.loads(meta.get("blocks") or "[]") or [f"layers.{i}.mlp" for i in range(n_layers)]
    k = k or (int(meta["k"]) if meta.get("k") else None)
    writer = {CIRCUIT_TRACER: _write_ct, CIRCUIT_TRACER_SET: _write_ct_set,
              SPARSIFY: _write_sparsify}  # fmt: skip
    out = Path(out_dir)
    with publishing(out) as tmp:
        writer[layout](tmp, tensors, decoders, blocks, k)
        if layout != SPARSIFY:
            _ct_sidecar(tmp, THRESHOLD_SOURCE, thresholds)
    return out


def _ct_sidecar(tmp: Path, key: str, value) -> None:
    """Add ``key`` to the config written in ``tmp``."""
    doc = json.loads((tmp / CT_CONFIG).read_text())
    (tmp / CT_CONFIG).write_text(json.dumps(doc | {key: value}, indent=2) + "\n")


def export_transcoder_set(transcoders: list, out_dir: Path) -> Path:
    """Write per-layer transcoders (``[(name, tensors, info)]`` as ``read_sae`` gives them,
    in layer order: layer l is the l-th) as circuit-tracer's transcoder set: each
    ``layer_{l}.safetensors`` as ``SingleLayerTranscoder.to_safetensors`` writes it (a
    skip transcoder's ``skip_weight`` as ``W_skip``), and the config naming the files,
    the hooks (``mlp.hook_in``, ``mlp.hook_out``), the blocks the files record, their
    common ``k`` and ``threshold_source``; whole or not at all. Each must hold thresholds
    (circuit-tracer has no top-k) and one width."""
    from .architectures.clt import block_of

    if not transcoders:
        raise CheckpointError("no transcoders to write as a set")
    blocks, ks, sources, width = [], set(), set(), None
    for name, t, info in transcoders:
        if info["architecture"] not in ("transcoder", "skip_transcoder"):
            raise CheckpointError(f"{name}: a {info['architecture']} SAE, not a transcoder")
        n, d = t["encoder_weight"].shape
        width = width or (n, d)
        if (n, d) != width:
            raise CheckpointError(
                f"{name}: {n} latents of width {d}; the first transcoder's {width[0]} of "
                f"{width[1]} (circuit-tracer's set has one)"
            )
        if t["decoder_bias"].shape[0] != d:
            raise CheckpointError(
                f"{name}: a transcoder from {d} to {t['decoder_bias'].shape[0]} dimensions; "
                "circuit-tracer's transcoders have one width (the model's)"
            )
        _needs_thresholds(name, info.get("threshold_source"))
        meta = info.get("metadata") or {}
        config = meta.get("config") if isinstance(meta.get("config"), dict) else {}
        hook = meta.get("hook_point") or config.get("hook_point")
        blocks.append(block_of(hook) if hook else None)
        ks.add(info.get("k"))
        sources.add(info["threshold_source"])
    doc = {"model_kind": "transcoder_set", "feature_input_hook": CT_INPUT_HOOK,
           "feature_output_hook": CT_OUTPUT_HOOK,
           "transcoders": [f"layer_{layer}.safetensors" for layer in range(len(transcoders))]}  # fmt: skip
    if all(blocks):
        if len(set(blocks)) != len(blocks) or blocks != sorted(blocks, key=_natural):
            raise CheckpointError(
                f"the transcoders record blocks {blocks}: not one per layer in layer order "
                "(a set's l-th file is layer l)"
            )
        doc["blocks"] = blocks
    if len(ks) == 1 and None not in ks:
        doc["k"] = ks.pop()
    if len(sources) == 1:
        doc[THRESHOLD_SOURCE] = sources.pop()
    out = Path(out_dir)
    with publishing(out) as tmp:
        for layer, (_, t, _) in enumerate(transcoders):
            weights = {theirs: _np(t[ours]) for theirs, ours in CT_TRANSCODER.items()}
            weights[CT_THRESHOLD] = _np(t["threshold"])
            if "skip_weight" in t:
                weights["W_skip"] = _np(t["skip_weight"])
            write_shard(tmp / f"layer_{layer}.safetensors", weights, {"format": "pt"})
        (tmp / CT_CONFIG).write_text(json.dumps(doc, indent=2) + "\n")
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
