"""SAE files of other trainers, read into our convention and written in theirs.

Our convention (``checkpoint.py``): ``z = TopK(ReLU(W_enc (x - b_dec) + b_enc))``,
``x_hat = z W_dec + b_dec`` with ``encoder_weight [n, d]``, ``encoder_bias [n]``,
``decoder_weight [n, d]``, ``decoder_bias [d]``. Recognised layouts:

- ours: a ``.safetensors`` file, or a run / checkpoint directory holding ``sae.safetensors``
  with our tensor names (``k`` from the metadata);
- SAELens: ``cfg.json`` + ``sae_weights.safetensors`` with ``W_enc [d, n]``, ``b_enc``,
  ``W_dec [n, d]``, ``b_dec``; architecture "topk" (``k`` from the config), "jumprelu"
  (and ``threshold [n]``, or the training layout's ``log_threshold``) or "standard" (a
  ReLU SAE: read as a JumpReLU SAE whose thresholds are 0, which encodes exactly
  ``ReLU(pre)`` and which SAELens' jumprelu loads back). Without
  ``apply_b_dec_to_input`` the encoder bias is folded (``b_enc + W_enc b_dec``); with
  ``rescale_acts_by_decoder_norm`` (TopK only; refused for the others) the decoder norms
  are folded into the encoder, both exactly (the same latents, the same reconstruction);
- sparsify: ``cfg.json`` + ``sae.safetensors`` with ``encoder.weight [n, d]``,
  ``encoder.bias``, ``W_dec [n, d]``, ``b_dec`` (``activation`` "topk") -- the same
  encoding as ours; with ``transcode`` a transcoder (the input read uncentred), with
  ``skip_connection`` as well a skip transcoder whose ``W_skip [d, d]`` is our
  ``skip_weight``. sparsify's coders have one width (``d_in``), so only a transcoder
  with ``d_out = d_in`` goes there; its transcoders' decoder rows are not unit norm
  (read as they are: the same outputs). A skip connection without ``transcode`` (an
  SAE of its input plus a linear path) has no architecture here and is refused.

SAELens 6's ``transcoder`` and ``skip_transcoder`` encode with a ReLU (every positive
pre-activation), not a top-k, and its ``jumprelu_*transcoder`` with thresholds: none
encodes as our TopK transcoders do, so both directions are refused rather than changing
which latents fire. A BatchTopK or Matryoshka SAE goes to SAELens as SAELens saves its
own: a JumpReLU SAE whose every threshold is the learned one (``read_sae``'s
``info["threshold"]``, from our metadata); it encodes as ours wherever a row has at most
``BATCH_TOPK_ROW_CAP * k`` pre-activations above the threshold (ours keeps that many per
row at most, SAELens' JumpReLU has no cap). One never trained (threshold 0) is refused,
and so is sparsify (no thresholds there). Crosscoders have no layout in either library.

A circuit-tracer per-layer transcoder file (``layer_{l}.safetensors``: ``W_enc``, ``W_dec``,
``b_enc``, ``b_dec``, optional ``activation_function.threshold`` and ``W_skip``) reads as a
transcoder (a skip transcoder with ``W_skip``) with its thresholds and no ``k``
(``clt_interop.read_ct_transcoder``); a directory of sparsify transcoders, one per hook
point (``sparsify_transcoders``), is a per-layer set the replacement model reads.

``read_sae``'s info names the ``threshold_source`` of the file's JumpReLU thresholds
(``architectures/clt.py``'s ``THRESHOLD_SOURCES``; None when it holds none): the
metadata's; SAELens' JumpReLU and ReLU (thresholds 0) SAEs' and circuit-tracer's are
"peer"; a JumpReLU SAE of ours "trained"; a CLT of ours written before the key, with
non-zero thresholds, "calibrated" (the trainer calibrated them before every checkpoint).

``read_sae``'s info names the ``architecture`` (``sae/architectures/``);
``load_sae_model`` gives any of them as that architecture's module; ``export_sae`` writes
ours in the SAELens layout (TopK, JumpReLU) or the sparsify one (TopK, transcoders) so
that those libraries load it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from ..dataset.publish import publishing
from ..format import SafetensorsFile, write_shard
from ..format.errors import InvalidArgumentError
from .checkpoint import SAE_FILE, SAE_TENSORS, CheckpointError, load_sae

SAELENS_WEIGHTS, SPARSIFY_WEIGHTS, FOREIGN_CONFIG = (
    "sae_weights.safetensors",
    "sae.safetensors",
    "cfg.json",
)


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    with SafetensorsFile(path) as f:
        names = f.keys()
        return {n: torch.from_numpy(np.array(f.tensor(n), dtype=np.float32)) for n in names}


def _config(directory: Path) -> dict:
    try:
        cfg = json.loads((directory / FOREIGN_CONFIG).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{directory / FOREIGN_CONFIG}: unreadable ({e})") from e
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{directory / FOREIGN_CONFIG}: not a JSON object")
    return cfg


def _shapes_fit(path, t: dict[str, torch.Tensor]) -> None:
    n, d_in = t["encoder_weight"].shape
    d_out = t["decoder_bias"].shape[0] if t["decoder_bias"].ndim == 1 else -1
    want = {"encoder_bias": (n,), "decoder_weight": (n, d_out), "decoder_bias": (d_out,),
            "skip_weight": (d_out, d_in)}  # fmt: skip
    want |= {name: (n,) for name in t if name not in want and name != "encoder_weight"}
    want = {name: shape for name, shape in want.items() if name in t}
    for name, shape in want.items():
        if tuple(t[name].shape) != shape:
            raise CheckpointError(
                f"{path}: {name} has shape {list(t[name].shape)}, expected {list(shape)}"
            )


def read_sae(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict]:
    """``(tensors in our convention, float32; info)`` of an SAE in any recognised
    layout; ``info``: ``layout`` ("ours", "saelens", "sparsify"), ``architecture``
    (a key of ``ARCHITECTURES``), ``k`` (or None) and the source's ``metadata`` /
    ``config``; a BatchTopK or Matryoshka SAE's inference ``threshold`` (0.0 when none was
    recorded)."""
    tensors, info = _read(Path(path))
    info["threshold_source"] = _threshold_source(path, tensors, info)
    if info["architecture"] in ("batchtopk", "matryoshka"):
        # the inference threshold is one scalar, kept in the metadata
        info["threshold"] = float((info.get("metadata") or {}).get("threshold", 0) or 0)
    return tensors, info


def _read(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    from . import clt_interop

    if path.is_file():
        if clt_interop.is_ct_transcoder(path):
            return clt_interop.read_ct_transcoder(path)
        tensors, meta = load_sae(path)
        arch = meta.get("architecture") or meta.get("activation") or "topk"
        return tensors, {"layout": "ours", "architecture": arch,
                         "k": _int_or_none(meta.get("k")), "metadata": meta}  # fmt: skip
    if not path.is_dir():
        raise CheckpointError(f"{path}: no SAE file or directory")
    layout = clt_interop.detect(path)
    if layout is not None:  # another library's cross-layer transcoder or transcoder set
        return clt_interop.read_clt(path, layout)
    if (path / SAELENS_WEIGHTS).is_file() and (path / FOREIGN_CONFIG).is_file():
        return _read_saelens(path)
    if (path / SPARSIFY_WEIGHTS).is_file():
        with SafetensorsFile(path / SPARSIFY_WEIGHTS) as f:
            names = set(f.keys())
        if "encoder.weight" in names:
            return _read_sparsify(path)
        return _read(path / SAE_FILE)
    raise CheckpointError(
        f"{path}: not an SAE directory: expected our {SAE_FILE}, SAELens' {FOREIGN_CONFIG} + "
        f"{SAELENS_WEIGHTS}, or sparsify's {FOREIGN_CONFIG} + {SPARSIFY_WEIGHTS}"
    )


def _threshold_source(path, tensors: dict[str, torch.Tensor], info: dict) -> str | None:
    """How the file's JumpReLU thresholds were set (module docstring), None without."""
    from .architectures.clt import THRESHOLD_SOURCE, THRESHOLD_SOURCES

    recorded = (info.get("metadata") or {}).get(THRESHOLD_SOURCE)
    if recorded is not None:
        if recorded not in THRESHOLD_SOURCES:
            raise CheckpointError(
                f"{path}: {THRESHOLD_SOURCE} {recorded!r}, not one of {THRESHOLD_SOURCES}"
            )
        return recorded
    if "threshold" not in tensors:
        return None
    if info["layout"] == "saelens":
        return "peer"  # its JumpReLU, or its ReLU read as thresholds 0: the same code
    if info["layout"] == "ours" and info["architecture"] == "jumprelu":
        return "trained"  # a JumpReLU SAE's thresholds are its trained parameters
    ours_clt = info["layout"] == "ours" and info["architecture"] == "clt"
    if ours_clt and bool(tensors["threshold"].any()):
        # a CLT of ours written before the key: the trainer calibrated its thresholds
        # before every checkpoint (calibrate_thresholds); a never calibrated one's are 0
        return "calibrated"
    return None


def sparsify_transcoders(path: str | os.PathLike) -> dict[str, Path]:
    """``{hook point: directory}`` of a sparsify run's per-layer transcoders (a directory
    holding one ``cfg.json`` + ``sae.safetensors`` directory per hook point, named by it,
    ``transcode`` set, no cross-layer ``n_targets``), sorted as sparsify sorts them; {} when
    ``path`` is not one."""
    path = Path(path)
    found = {}
    for sub in sorted(path.iterdir()) if path.is_dir() else ():
        if not ((sub / FOREIGN_CONFIG).is_file() and (sub / SPARSIFY_WEIGHTS).is_file()):
            continue
        try:
            cfg = json.loads((sub / FOREIGN_CONFIG).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(cfg, dict) and cfg.get("transcode") and not cfg.get("n_targets"):
            found[sub.name] = sub
    from .clt_interop import _natural

    return {name: found[name] for name in sorted(found, key=_natural)}


def _int_or_none(value) -> int | None:
    return int(value) if value not in (None, "") else None


def _read_saelens(directory: Path) -> tuple[dict[str, torch.Tensor], dict]:
    cfg = _config(directory)
    arch = cfg.get("architecture", "standard")
    if "transcoder" in arch:
        raise CheckpointError(
            f"{directory}: a SAELens {arch!r}, which encodes with a ReLU (every positive "
            "pre-activation) or per-latent thresholds; this package's transcoders keep the "
            "top k per row, so it would not encode the same"
        )
    k = cfg.get("k")
    activation = cfg.get("activation_fn_str", "relu")  # SAELens < 6 names it here
    if arch not in ("topk", "jumprelu") and activation == "topk":
        arch, k = "topk", (cfg.get("activation_fn_kwargs") or {}).get("k")
    relu = arch == "standard" and activation == "relu"
    if arch not in ("topk", "jumprelu") and not relu:
        raise CheckpointError(
            f"{directory}: a SAELens {arch!r} SAE"
            + (f" with activation {activation!r}" if arch == "standard" else "")
            + "; only TopK, JumpReLU and ReLU (standard) SAEs encode the way this package does"
        )
    if arch == "topk" and (not isinstance(k, int) or k < 1):
        raise CheckpointError(f"{directory / FOREIGN_CONFIG}: no positive integer 'k'")
    if arch != "topk" and cfg.get("rescale_acts_by_decoder_norm", False):
        raise CheckpointError(
            f"{directory}: a ReLU (standard) SAE with rescale_acts_by_decoder_norm, which "
            "SAELens' StandardSAE does not apply; save it without the flag"
            if relu
            else f"{directory}: a JumpReLU SAE with rescale_acts_by_decoder_norm; save it with "
            "the decoder norms folded into W_enc, b_enc and threshold"
        )
    if cfg.get("normalize_activations", "none") != "none":
        raise CheckpointError(
            f"{directory}: normalize_activations={cfg['normalize_activations']!r} rescales "
            "inputs outside the SAE's weights; fold it first (SAELens: "
            "fold_activation_norm_scaling_factor) or save with 'none'"
        )
    raw = _read_tensors(directory / SAELENS_WEIGHTS)
    missing = sorted({"W_enc", "b_enc", "W_dec", "b_dec"} - set(raw))
    if missing:
        raise CheckpointError(f"{directory / SAELENS_WEIGHTS}: missing tensor(s) {missing}")
    for name in ("finetuning_scaling_factor", "scaling_factor"):  # older SAELens, in decode
        if name in raw and not bool((raw[name] == 1).all()):
            raise CheckpointError(
                f"{directory / SAELENS_WEIGHTS}: a {name} other than 1 scales the code before "
                "decoding; fold it into W_dec first"
            )
    w_enc, b_enc = raw["W_enc"].T.contiguous(), raw["b_enc"].clone()
    w_dec, b_dec = raw["W_dec"].clone(), raw["b_dec"].clone()
    if not cfg.get("apply_b_dec_to_input", True):
        # ReLU(W x + b) = ReLU(W (x - b_dec) + (b + W b_dec))
        b_enc = (b_enc.double() + w_enc.double() @ b_dec.double()).float()
    if cfg.get("rescale_acts_by_decoder_norm", False):
        # top-k of (pre * |W_dec_i|), decoded by W_dec_i / |W_dec_i|: fold the norms
        norm = w_dec.norm(dim=1)
        w_enc, b_enc, w_dec = w_enc * norm[:, None], b_enc * norm, w_dec / norm[:, None]
    tensors = dict(zip(SAE_TENSORS, (w_enc, b_enc, w_dec, b_dec), strict=True))
    if arch == "jumprelu":
        tensors["threshold"] = _saelens_threshold(directory, raw)
    if relu:  # ReLU(pre) = pre * 1[pre > 0]: a JumpReLU SAE at threshold 0, exactly
        arch, tensors["threshold"] = "jumprelu", torch.zeros(w_enc.shape[0])
    _shapes_fit(directory, tensors)
    return tensors, {"layout": "saelens", "architecture": arch, "k": k, "config": cfg}


def _saelens_threshold(directory: Path, raw: dict[str, torch.Tensor]) -> torch.Tensor:
    """A JumpReLU SAE's ``threshold``, or ``exp(log_threshold)`` of SAELens' training
    layout."""
    if "threshold" in raw:
        return raw["threshold"].clone()
    if "log_threshold" in raw:
        return raw["log_threshold"].double().exp().float()
    raise CheckpointError(
        f"{directory / SAELENS_WEIGHTS}: a jumprelu SAE without 'threshold' or 'log_threshold'"
    )


def _read_sparsify(directory: Path) -> tuple[dict[str, torch.Tensor], dict]:
    cfg = _config(directory)
    if cfg.get("activation", "topk") != "topk":
        raise CheckpointError(f"{directory}: sparsify activation {cfg['activation']!r}, not topk")
    transcode, skip = bool(cfg.get("transcode")), bool(cfg.get("skip_connection"))
    if skip and not transcode:
        raise CheckpointError(
            f"{directory}: a sparsify SAE with a skip connection (an autoencoder of its input "
            "plus a linear path) has no architecture here; skip connections are read with "
            "transcode=true (a skip transcoder)"
        )
    k = cfg.get("k")
    if not isinstance(k, int) or k < 1:
        raise CheckpointError(f"{directory / FOREIGN_CONFIG}: no positive integer 'k'")
    raw = _read_tensors(directory / SPARSIFY_WEIGHTS)
    missing = sorted({"encoder.weight", "encoder.bias", "W_dec", "b_dec"} - set(raw))
    if missing:
        raise CheckpointError(f"{directory / SPARSIFY_WEIGHTS}: missing tensor(s) {missing}")
    names = ("encoder.weight", "encoder.bias", "W_dec", "b_dec")
    tensors = {ours: raw[theirs] for ours, theirs in zip(SAE_TENSORS, names, strict=True)}
    if skip:
        if "W_skip" not in raw:
            raise CheckpointError(f"{directory / SPARSIFY_WEIGHTS}: skip_connection but no W_skip")
        tensors["skip_weight"] = raw["W_skip"]
    _shapes_fit(directory, tensors)
    arch = ("skip_transcoder" if skip else "transcoder") if transcode else "topk"
    return tensors, {"layout": "sparsify", "architecture": arch, "k": k, "config": cfg}


def load_sae_model(
    path: str | os.PathLike, *, k: int | None = None, device: str | torch.device | None = None
):
    """An SAE file or directory (ours, SAELens, sparsify) as its architecture's module
    (``TopKSAE``, ``BatchTopKSAE``, ``JumpReLUSAE``, ``MatryoshkaSAE``, ``TranscoderSAE``,
    ``SkipTranscoderSAE``, ``CrosscoderSAE``, ``CrossLayerTranscoder``) with ``encode``, ``decode`` and ``forward``
    (a skip transcoder's ``forward`` adds its linear path to ``decode``): the trainer's
    exact encoding, on any device, without the trainer.

        sae = load_sae_model("runs/sae")            # or a checkpoint, a SAELens dir ...
        values, indices = sae.encode(x)             # [B, k] each
        x_hat = sae.decode(values, indices)
    """
    from .architectures import BatchTopKSAE, get_architecture

    tensors, info = read_sae(path)
    cls = get_architecture(info["architecture"])
    if info["architecture"] == "clt":
        return _clt_model(tensors, info["metadata"], k=k, device=device,
                          thresholds=info["threshold_source"])  # fmt: skip
    k = k or info["k"] or (None if cls.SELECTS_TOP_K else 1)  # else k is a training target
    if k is None and info["threshold_source"] is not None:
        raise CheckpointError(
            f"{path}: a {info['layout']} file that records no k: it encodes with its JumpReLU "
            "thresholds (circuits.load_replacement(..., rule='threshold')); pass k= for the "
            "top-k rule"
        )
    if k is None:
        raise CheckpointError(f"{path}: the file records no k; pass k=")
    n, d = tensors["encoder_weight"].shape
    meta = info.get("metadata") or {}
    sae = cls(d, n, min(k, n), d_out=tensors["decoder_bias"].shape[0], device=device,
              **cls.stored_options(meta))  # fmt: skip
    sae.load_full_state(tensors)
    if isinstance(sae, BatchTopKSAE):
        sae.threshold.fill_(info["threshold"])
    return sae.eval()


def _clt_model(tensors: dict[str, torch.Tensor], meta: dict, *, k=None, device=None,
               thresholds: str | None = None):  # fmt: skip
    """A ``CrossLayerTranscoder`` of our CLT file's tensors and metadata, its
    ``threshold_source`` ``thresholds`` (``read_sae``'s)."""
    from .architectures import CrossLayerTranscoder as CLT

    _, n, d_in = tensors["encoder_weight"].shape
    k = k or int(meta.get("k") or 0)
    if not k:
        raise CheckpointError(
            f"a CLT read from {meta.get('source_layout', 'a file')} records no k (it encodes "
            "with its thresholds: encode_layer(..., rule='threshold')); pass k= for the top-k rule"
        )
    clt = CLT(d_in, n, min(k, n), d_out=tensors["decoder_bias"].shape[1],
              device=device, **CLT.stored_options(meta))  # fmt: skip
    clt.load_full_state(tensors)
    clt.threshold_source = thresholds
    return clt.eval()


def export_sae(
    path: str | os.PathLike | Sequence[str | os.PathLike],
    out_dir: str | os.PathLike,
    layout: Literal["saelens", "sparsify", "circuit-tracer", "circuit-tracer-transcoders"],
    *,
    k: int | None = None,
) -> Path:
    """Write the SAE at ``path`` (any recognised layout) as a directory that SAELens
    (``SAE.load_from_disk``) or sparsify (``SparseCoder.load_from_disk``) loads and that
    encodes exactly as ours (a BatchTopK or Matryoshka SAE: as SAELens' JumpReLU at its
    threshold, module docstring); a cross-layer transcoder in circuit-tracer's layouts or
    sparsify's cross-layer one (``clt_interop``); per-layer transcoders (a list of files,
    layer l the l-th) as circuit-tracer's transcoder set (``"circuit-tracer-transcoders"``,
    its ``load_transcoder_set``); written whole or not at all. circuit-tracer encodes with
    JumpReLU thresholds, so only a dictionary that holds them (a ``threshold_source``) goes
    there."""
    from . import clt_interop
    from .architectures import get_architecture

    if not isinstance(path, str | os.PathLike):
        if layout != clt_interop.CIRCUIT_TRACER_SET:
            raise CheckpointError(
                f"several files go only to {clt_interop.CIRCUIT_TRACER_SET!r} (per-layer "
                f"transcoders as a set), not {layout!r}"
            )
        items = [(os.fspath(p), *read_sae(p)) for p in path]
        return clt_interop.export_transcoder_set(items, Path(out_dir))
    tensors, info = read_sae(path)
    arch = info["architecture"]
    if arch == "clt":
        if layout not in (clt_interop.CIRCUIT_TRACER, clt_interop.CIRCUIT_TRACER_SET, "sparsify"):
            raise CheckpointError(
                f"{path}: a cross-layer transcoder; SAELens has no cross-layer layout "
                "(write it as 'circuit-tracer' or 'sparsify')"
            )
        return clt_interop.export_clt(tensors, info["metadata"], Path(out_dir), layout, k=k,
                                      thresholds=info["threshold_source"])  # fmt: skip
    if layout == clt_interop.CIRCUIT_TRACER_SET and arch in ("transcoder", "skip_transcoder"):
        raise CheckpointError(
            f"{path}: one per-layer transcoder; circuit-tracer's set holds every layer from 0 "
            "(its l-th file is layer l): pass the transcoder files as a list, in layer order"
        )
    if layout.startswith("circuit-tracer"):
        raise CheckpointError(
            f"{path}: a {arch} SAE; circuit-tracer's layouts take a CLT or per-layer "
            "transcoders (a list of files, for 'circuit-tracer-transcoders')"
        )
    k = k or info["k"]
    if k is None and get_architecture(arch).SELECTS_TOP_K:
        raise CheckpointError(f"{path}: the file records no k; pass k=")
    d = tensors["encoder_weight"].shape[1]
    d_out = tensors["decoder_bias"].shape[0]
    meta = info.get("metadata", {})
    transcoder = arch in ("transcoder", "skip_transcoder")
    if arch in ("batchtopk", "matryoshka") and layout == "saelens":
        arch, tensors = _saelens_jumprelu(path, arch, tensors, info["threshold"])
    if arch in ("batchtopk", "matryoshka", "crosscoder") or (
        layout == "sparsify" and arch == "jumprelu"
    ) or (layout == "saelens" and transcoder):  # fmt: skip
        raise CheckpointError(
            f"{path}: a {arch} SAE; {layout} has no SAE that encodes the same way (SAELens "
            "and sparsify TopK SAEs and sparsify's transcoders encode per row; SAELens' "
            "transcoders encode with a ReLU; SAELens' jumprelu takes a JumpReLU SAE; no "
            "crosscoder layout), so the export would change which latents fire"
        )
    if transcoder and d_out != d:
        raise CheckpointError(
            f"{path}: a transcoder from {d} to {d_out} dimensions; sparsify's coders have one "
            "width (d_in), so it cannot store this one"
        )
    hook = meta.get("hook_point", "") if isinstance(meta, dict) else ""
    t = {name: v.contiguous().numpy() for name, v in tensors.items()}
    weights, cfg, weights_file = _foreign_files(layout, arch, t, k=k, hook=hook)
    out = Path(out_dir)
    with publishing(out) as tmp:
        write_shard(tmp / weights_file, weights, {"format": "pt"})
        (tmp / FOREIGN_CONFIG).write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def _saelens_jumprelu(path, arch: str, tensors: dict[str, torch.Tensor], threshold: float):
    """``("jumprelu", tensors with a threshold per latent)``: a BatchTopK or Matryoshka SAE
    as SAELens saves its own (module docstring)."""
    if threshold <= 0:
        raise CheckpointError(
            f"{path}: a {arch} SAE without a learned threshold (never trained); SAELens "
            "would encode it with every positive pre-activation"
        )
    n = tensors["encoder_weight"].shape[0]
    return "jumprelu", tensors | {"threshold": torch.full((n,), threshold)}


def _foreign_files(
    layout: str, arch: str, t: dict[str, np.ndarray], *, k: int | None, hook: str
) -> tuple[dict[str, np.ndarray], dict, str]:
    """``(weights, config, weights file name)`` of an SAE's tensors ``t`` in SAELens' or
    sparsify's layout (what ``export_sae`` writes, its refusals already made)."""
    n, d = t["encoder_weight"].shape
    transcoder = arch in ("transcoder", "skip_transcoder")
    if layout == "saelens":
        weights = {"W_enc": np.ascontiguousarray(t["encoder_weight"].T), "b_enc": t["encoder_bias"],
                   "W_dec": t["decoder_weight"], "b_dec": t["decoder_bias"]}  # fmt: skip
        cfg = {
            "architecture": arch, "d_in": d, "d_sae": n, "dtype": "float32",
            "device": "cpu", "apply_b_dec_to_input": True, "normalize_activations": "none",
            "reshape_activations": "none", "metadata": {"hook_name": hook},
        }  # fmt: skip
        if arch == "jumprelu":
            weights["threshold"] = t["threshold"]
        else:
            cfg |= {"k": k, "rescale_acts_by_decoder_norm": False}
        weights_file = SAELENS_WEIGHTS
    elif layout == "sparsify":
        weights = {"encoder.weight": t["encoder_weight"], "encoder.bias": t["encoder_bias"],
                   "W_dec": t["decoder_weight"], "b_dec": t["decoder_bias"]}  # fmt: skip
        if "skip_weight" in t:
            weights["W_skip"] = t["skip_weight"]
        cfg = {
            "activation": "topk", "expansion_factor": max(1, n // d), "normalize_decoder": True,
            "num_latents": n, "k": k, "multi_topk": False,
            "skip_connection": "skip_weight" in t, "transcode": transcoder, "d_in": d,
        }  # fmt: skip
        weights_file = SPARSIFY_WEIGHTS
    else:
        raise InvalidArgumentError(f"layout must be 'saelens' or 'sparsify', got {layout!r}")
    return weights, cfg, weights_file
