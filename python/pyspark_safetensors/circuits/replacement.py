"""The replacement model: a Hugging Face causal LM whose MLP blocks are all replaced at once
by a dictionary's outputs, computed from the MLP inputs the replaced model itself produces
(Ameisen et al. 2025's replacement model: errors compound through the layers). The one
replacement model of the project: the whole-network evaluation (``evaluate.py``), the
LUTs' (``lut_replacement``), attribution graphs (``graphs``, on its frozen local mode,
``local.py``) and interventions (``interventions.py``) all run it.

A ``Replacement`` is one dense description of what replaces the blocks, whatever it came
from (a cross-layer transcoder, a set of per-layer transcoders, a LUT directory):

    z_l = act_l(x_l W_enc^l^T + b_enc^l)                        [N, n_l]
    y_hat_t = sum_{l in sources(t)} z_l W_dec^{l->t} + b_dec^t  (+ x_t W_skip^t^T)

``act_l`` keeps the top ``k`` of ``ReLU(pre)`` per row, or (``rule="threshold"``)
``pre * 1[pre > threshold]`` with the dictionary's own JumpReLU thresholds: a CLT's
calibrated ones, circuit-tracer's (its only rule; a ReLU transcoder's thresholds are 0).
The threshold rule is refused for a dictionary that holds none (its ``threshold_source``,
``sae/architectures/clt.py``, absent: top-k transcoders, sparsify's coders, a CLT never
calibrated), and the top-k rule for one that records no ``k`` unless given one. A CLT's
``sources(t)`` are the layers ``0..t``; a per-layer transcoder's are ``{t}`` alone.
``load_replacement`` makes one of any of these, ours or as other libraries write them
(circuit-tracer's CLT and transcoder sets, sparsify's cross-layer and per-layer runs);
their names for the blocks (``blocks.{i}.mlp.hook_in``, ``layers.{i}.mlp``, ...) resolve
to the model's by one rule, ``block_of``.

``ReplacementModel(model, replacement)`` hooks each replaced block: the block still runs
(its true output on this run's input is what an error node needs), its input is encoded,
the codes of this forward pass are kept in layer order, and the block's output becomes
``y_hat_t``, at the positions ``where`` says (default: every position):

    rm = ReplacementModel.load("models/toy", "runs/clt")   # model, tokenizer, dictionary
    run = rm.forward(batch, record=True)       # logits and, per block, input/output/codes
    run.trace.codes["model.layers.1.mlp"]      # [batch, seq, n] active features
    with rm.hooked(where=mask):                # or around any call of the model
        logits = rm.model(**batch).logits
    local = rm.capture(token_ids)              # one prompt's frozen local replacement model
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..format.errors import InvalidArgumentError
from .errors import ReplacementError

RULES = ("topk", "threshold")
"""How a layer's latents are chosen at inference (``Replacement.encode``)."""


@dataclass
class Replacement:
    """What replaces the MLP blocks ``blocks`` (module names, in layer order), in float32:
    per layer ``l`` its encoder ``encoder_weight[l] [n_l, d_in]``, ``encoder_bias[l]``,
    ``k`` and optional ``threshold[l] [n_l]`` (the JumpReLU rule; ``k`` may then be None);
    per target ``t`` its
    decoders ``decoders[t] = {source l: W_dec^{l->t} [n_l, d_out]}``, ``decoder_bias[t]``
    and optional ``skip[t] [d_out, d_in]``."""

    blocks: tuple[str, ...]
    encoder_weight: list[torch.Tensor]
    encoder_bias: list[torch.Tensor]
    decoders: list[dict[int, torch.Tensor]]
    decoder_bias: list[torch.Tensor]
    k: int | None
    threshold: list[torch.Tensor] | None = None
    skip: list[torch.Tensor | None] = field(default_factory=list)

    def __post_init__(self):
        if not self.skip:
            self.skip = [None] * len(self.blocks)
        if self.threshold is None and not self.k:
            raise InvalidArgumentError("a replacement without thresholds keeps the top k: give k")
        for t, decoders in enumerate(self.decoders):
            if any(not 0 <= s <= t for s in decoders):
                raise InvalidArgumentError(
                    f"layer {t} decodes from {sorted(decoders)}; sources <= t"
                )

    @property
    def n_layers(self) -> int:
        return len(self.blocks)

    @property
    def rule(self) -> str:
        """How a layer's latents are chosen: "threshold" when the JumpReLU thresholds are
        held, else "topk"."""
        return "topk" if self.threshold is None else "threshold"

    def sources(self, target: int) -> list[int]:
        """The layers whose codes layer ``target``'s output is decoded from."""
        return sorted(self.decoders[target])

    def decoder(self, source: int, target: int) -> torch.Tensor:
        """``W_dec^{source->target} [n_source, d_out]``."""
        return self.decoders[target][source]

    def to(self, device) -> Replacement:
        """The same replacement with every tensor on ``device``."""

        def move(t):
            return None if t is None else t.to(device)

        return Replacement(
            self.blocks, [move(w) for w in self.encoder_weight], [move(b) for b in self.encoder_bias],
            [{s: move(w) for s, w in d.items()} for d in self.decoders],
            [move(b) for b in self.decoder_bias], self.k,
            None if self.threshold is None else [move(t) for t in self.threshold],
            [move(s) for s in self.skip],
        )  # fmt: skip

    @torch.no_grad()
    def encode(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Layer ``layer``'s dense code ``[N, n_l]`` of its MLP inputs ``x [N, d_in]``."""
        w = self.encoder_weight[layer]
        pre = torch.addmm(self.encoder_bias[layer], x.to(w.dtype), w.t())
        if self.threshold is not None:
            return pre * (pre > self.threshold[layer])
        vals, idx = pre.relu().topk(min(self.k, pre.shape[1]), dim=1)
        return torch.zeros_like(pre).scatter_(1, idx, vals)

    @torch.no_grad()
    def decode(
        self, target: int, codes: Sequence[torch.Tensor], x: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``y_hat_target [N, d_out]`` from the codes of layers ``0..target`` (and the
        target's input ``x`` when it has a skip path)."""
        out = self.decoder_bias[target].expand(len(codes[target]), -1).clone()
        for source, w in self.decoders[target].items():
            out.addmm_(codes[source].to(w.dtype), w)
        if self.skip[target] is not None:
            out.addmm_(x.to(out.dtype), self.skip[target].t())
        return out


# --- building a replacement for a model -------------------------------------------------


def model_blocks(model) -> list[str]:
    """The module names of a model's MLP blocks, in layer order (``model.layers.N.mlp``;
    the extraction's ``mlp_layers`` rule). A dictionary's names for them, ours or another
    library's (``blocks.{i}.mlp.hook_in``, sparsify's ``layers.{i}.mlp``, ...), are
    resolved against this list by the one rule, ``sae.architectures.clt.block_of``."""
    from ..extract.model import mlp_blocks

    blocks = mlp_blocks(model)
    spread = [b.layer for b in blocks if not b.module]
    if spread:
        raise ReplacementError(
            f"{type(model).__name__}: the MLP of layers {spread} is spread over modules (no one "
            "module is the whole block), which a replacement swaps whole"
        )
    return [b.module for b in blocks]


def _resolved(where: str, names: Sequence[str], blocks: Sequence[str]) -> list[str]:
    """The model blocks ``names`` mean (``block_of``), refused as a ``ReplacementError``
    naming ``where``."""
    from ..sae.architectures.clt import block_of

    try:
        return [block_of(name, blocks) for name in names]
    except InvalidArgumentError as e:
        raise ReplacementError(f"{where}: {e}") from None


def _hidden(model) -> int:
    config = (
        model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    )
    for key in ("hidden_size", "n_embd", "d_model"):
        if getattr(config, key, None):
            return int(getattr(config, key))
    raise ReplacementError(f"{type(model).__name__}: its config names no hidden size")


def _fits(where: str, name: str, shape, expected, why: str) -> None:
    """Refuse a tensor whose shape is not ``expected`` (None entries match anything)."""
    shape = tuple(shape)
    if len(shape) != len(expected) or any(
        e is not None and s != e for s, e in zip(shape, expected, strict=False)
    ):
        shown = [("n" if e is None else e) for e in expected]
        raise ReplacementError(f"{where}: {name} has shape {list(shape)}; expected {shown} ({why})")


def _covered_blocks(model, where: str, recorded: Sequence[str], n_layers: int, tensor: str, shape):
    """The model blocks a dictionary of ``n_layers`` layers replaces: those its hook points
    ``recorded`` name (in any convention ``block_of`` reads), checked against the model,
    else every block of the model."""
    blocks = model_blocks(model)
    if recorded:
        resolved = _resolved(where, recorded, blocks)
        if len(set(resolved)) != len(resolved) or sorted(resolved, key=blocks.index) != resolved:
            raise ReplacementError(
                f"{where}: blocks {list(recorded)} are not in layer order (the model's: {blocks})"
            )
        return tuple(resolved)
    if n_layers != len(blocks):
        expected = (len(blocks), *shape[1:])
        raise ReplacementError(
            f"{where}: {tensor} has shape {list(shape)}; expected {list(expected)} (it names no "
            f"blocks, so it must cover the model's {len(blocks)} MLP blocks)"
        )
    return tuple(blocks)


#: What to do about a dictionary without thresholds asked for the threshold rule.
_NO_THRESHOLDS = (
    "use rule='topk', or give it JumpReLU thresholds first: a CLT trained here has them "
    "calibrated at every checkpoint (pyspark-safetensors train; "
    "CrossLayerTranscoder.calibrate_thresholds sets them on training rows), and "
    "circuit-tracer's JumpReLU transcoders carry their own"
)


def _threshold_source(module) -> str | None:
    """How a dictionary module's thresholds were set: its ``threshold_source`` (a file's,
    set by ``load_sae_model``), else, for a module holding non-zero ones, "calibrated"
    (as a file of ours written before the key: the trainer calibrated them); None when it
    holds none."""
    source = getattr(module, "threshold_source", None)
    threshold = getattr(module, "threshold", None)
    if source is None and isinstance(threshold, torch.Tensor) and threshold.ndim:
        source = "calibrated" if bool(threshold.any()) else None
    return source


def _check_rule(rule: str) -> None:
    if rule not in RULES:
        raise InvalidArgumentError(f"rule must be one of {RULES}, got {rule!r}")


def clt_replacement(model, clt, *, rule: str = "topk", k: int | None = None) -> Replacement:
    """The replacement a cross-layer transcoder (a ``CrossLayerTranscoder`` or a path
    ``read_sae`` reads: ours, circuit-tracer's, sparsify's) gives ``model``: the blocks its
    hook points name (``block_of``: ours, circuit-tracer's ``blocks.{i}.mlp.hook_in``,
    sparsify's ``layers.{i}.mlp``) or, when it records none, every MLP block of the model.
    ``rule="topk"`` keeps the top ``k`` (the file's unless given: refused when it records
    none, as circuit-tracer's do); ``rule="threshold"`` encodes with its JumpReLU
    thresholds, refused when it holds none (no ``threshold_source``: a CLT never
    calibrated, sparsify's). Refused, naming the tensor and the shape expected, when its
    layers or widths do not fit the model."""
    from ..sae.architectures import CrossLayerTranscoder
    from ..sae.ecosystem import _clt_model, read_sae

    _check_rule(rule)
    if isinstance(clt, str | os.PathLike):
        where = os.fspath(clt)
        tensors, info = read_sae(clt)
        if info["architecture"] != "clt":
            raise ReplacementError(
                f"{where}: a {info['architecture']} SAE, not a cross-layer transcoder (per-layer "
                "transcoders: load_replacement or transcoder_replacement)"
            )
        k, source = k or info["k"], info["threshold_source"]
        # the module's own k is not the replacement's (which encodes itself): any will do
        module = _clt_model(tensors, info["metadata"], k=k or 1, thresholds=source)
        layout = info["metadata"].get("source_layout", "ours")
    else:
        where, module, layout = "the CLT", clt, "ours"
        if not isinstance(module, CrossLayerTranscoder):
            raise ReplacementError(
                f"{where}: a {type(module).__name__}, not a cross-layer transcoder"
            )
        k, source = k or module.k, _threshold_source(module)
    if rule == "topk" and not k:
        raise ReplacementError(
            f"{where}: rule 'topk': the CLT ({layout}) records no k (it encodes with its "
            "JumpReLU thresholds: rule='threshold'); pass k= for the top-k rule"
        )
    if rule == "threshold" and source is None:
        why = ", which keeps the top k per layer" if layout == "sparsify" else ""
        raise ReplacementError(
            f"{where}: rule 'threshold': the CLT ({layout}{why}) holds no JumpReLU thresholds "
            f"(no threshold_source); {_NO_THRESHOLDS}"
        )
    L, n, d = module.n_layers, module.n_latents, _hidden(model)
    shape = tuple(module.encoder_weight.shape)
    blocks = _covered_blocks(model, where, module.hook_points, L, "encoder_weight", shape)
    _fits(where, "encoder_weight", shape, (len(blocks), n, d), f"the model's MLP blocks read {d}")
    _fits(where, "decoder_bias", module.decoder_bias.shape, (len(blocks), d),
          f"the model's MLP blocks write {d}")  # fmt: skip
    f32 = lambda t: t.detach().float()  # noqa: E731
    return Replacement(
        blocks,
        [f32(module.encoder_weight[i]) for i in range(L)],
        [f32(module.encoder_bias[i]) for i in range(L)],
        [{s: f32(module.decoder(s, t)) for s in range(t + 1)} for t in range(L)],
        [f32(module.decoder_bias[t]) for t in range(L)],
        k,
        [f32(module.threshold[i]) for i in range(L)] if rule == "threshold" else None,
    )


def recorded_block(path: str | os.PathLike, blocks: Sequence[str] | None = None) -> str:
    """The MLP block a per-layer dictionary file records: its ``hook_point`` (metadata or
    saved config), or for sparsify's coder directory its name (sparsify names each by its
    hook point); refused when it records none. With ``blocks`` (``model_blocks``), the
    one of them it means (``block_of``)."""
    import json

    from ..sae.architectures.clt import block_of
    from ..sae.ecosystem import read_sae

    info = read_sae(path)[1]
    meta = info.get("metadata") or {}
    config = meta.get("config", "{}")
    config = json.loads(config) if isinstance(config, str) else config
    hook = meta.get("hook_point") or (config or {}).get("hook_point")
    if not hook and info["layout"] == "sparsify":
        hook = os.path.basename(os.path.normpath(path))
    if not hook:
        raise ReplacementError(
            f"{path}: the file records no hook_point; give the transcoders as "
            "{block module name: file} (or circuit-tracer's set directory with its config.yaml)"
        )
    if blocks is None:
        return block_of(hook)
    return _resolved(os.fspath(path), [hook], blocks)[0]


def _transcoder_parts(where: str, tc) -> tuple[dict, int | None, str | None]:
    """``(full-shape tensors, k, threshold_source)`` of a per-layer transcoder: a module
    (``TranscoderSAE``, ``SkipTranscoderSAE``) or a file or directory ``read_sae`` reads
    (ours, sparsify's, circuit-tracer's ``layer_{l}.safetensors``)."""
    from ..sae.ecosystem import read_sae

    if isinstance(tc, str | os.PathLike):
        tensors, info = read_sae(tc)
        arch, k, source = info["architecture"], info["k"], info["threshold_source"]
    else:
        arch = getattr(tc, "ARCHITECTURE", type(tc).__name__)
        tensors = tc.full_state() if hasattr(tc, "full_state") else {}
        k, source = getattr(tc, "k", None), _threshold_source(tc)
        if isinstance(getattr(tc, "threshold", None), torch.Tensor) and source is not None:
            tensors["threshold"] = tc.threshold.detach()
    if arch not in ("transcoder", "skip_transcoder"):
        raise ReplacementError(f"{where}: a {arch} SAE, not a transcoder")
    if source is None:
        tensors.pop("threshold", None)  # zeros of no rule: never the threshold rule's
    return tensors, k, source


def transcoder_replacement(
    model, transcoders: Mapping[str, object] | Sequence[str | os.PathLike], *,
    rule: str = "topk", k: int | None = None,
) -> Replacement:  # fmt: skip
    """The replacement a set of per-layer transcoders gives ``model``: ``{block: transcoder}``
    (the block in any convention ``block_of`` reads; a ``TranscoderSAE``/``SkipTranscoderSAE``
    or a path: ours, sparsify's, a circuit-tracer ``layer_{l}.safetensors``), or files that
    each record their block (``recorded_block``); each block decoded from its own code
    alone (the CLT's ``l -> l`` special case), plus its skip path. ``rule="topk"``: the top
    ``k`` (the files', which must agree, unless given); ``rule="threshold"``: each one's
    own JumpReLU thresholds, refused for any that holds none (a top-k transcoder)."""
    _check_rule(rule)
    blocks, d = model_blocks(model), _hidden(model)
    if not isinstance(transcoders, Mapping):
        transcoders = {recorded_block(p, blocks): p for p in transcoders}
    names = list(transcoders)
    resolved = _resolved("the transcoders", names, blocks)
    if len(set(resolved)) != len(resolved):
        raise ReplacementError(f"transcoders {names} name blocks {resolved}: one each, please")
    by_block = dict(zip(resolved, (transcoders[n] for n in names), strict=True))
    ordered = [b for b in blocks if b in by_block]
    enc_w, enc_b, decs, dec_b, skips, thresholds, ks, missing = [], [], [], [], [], [], set(), []
    for t, block in enumerate(ordered):
        tc = by_block[block]
        where = os.fspath(tc) if isinstance(tc, str | os.PathLike) else f"the transcoder of {block}"
        state, tc_k, source = _transcoder_parts(where, tc)
        _fits(where, "encoder_weight", state["encoder_weight"].shape, (None, d),
              f"{block} reads {d}")  # fmt: skip
        _fits(where, "decoder_weight", state["decoder_weight"].shape,
              (state["encoder_weight"].shape[0], d), f"{block} writes {d}")  # fmt: skip
        enc_w.append(state["encoder_weight"].float())
        enc_b.append(state["encoder_bias"].float())
        decs.append({t: state["decoder_weight"].float()})
        dec_b.append(state["decoder_bias"].float())
        skips.append(state["skip_weight"].float() if "skip_weight" in state else None)
        thresholds.append(state["threshold"].float() if "threshold" in state else None)
        ks.add(tc_k)
        if (rule == "threshold" and source is None) or (rule == "topk" and not (k or tc_k)):
            missing.append(where)
    if missing and rule == "threshold":
        raise ReplacementError(
            f"rule 'threshold': {missing} hold no JumpReLU thresholds (no threshold_source: "
            f"top-k transcoders); {_NO_THRESHOLDS}"
        )
    if missing:
        raise ReplacementError(
            f"rule 'topk': {missing} record no k (they encode with their JumpReLU thresholds: "
            "rule='threshold'); pass k= for the top-k rule"
        )
    if rule == "topk" and not k:
        if len(ks) != 1:
            raise ReplacementError(
                f"the transcoders disagree on k ({sorted(ks)}); a replacement has one (pass k=)"
            )
        k = ks.pop()
    threshold = thresholds if rule == "threshold" else None
    return Replacement(tuple(ordered), enc_w, enc_b, decs, dec_b, k, threshold, skips)


def lut_replacement(model, lut_dir: str | os.PathLike) -> Replacement:
    """The replacement the MLP blocks of a LUT directory give ``model`` (``kind: "mlp"``
    entries; a cross-layer block's ``sources`` name the blocks whose codes its
    ``precomputed_products`` rows follow, in order). Tensors are read in their stored
    dtype (float16, bfloat16) and computed in float32."""
    from ..lut.inference import load_layer_file
    from ..lut.spec import MLP, entry_kind, validate_lut

    meta = validate_lut(lut_dir)
    k, n = meta["sae_config"]["k_active"], meta["sae_config"]["num_basis"]
    entries = {name: e for name, e in meta["layers"].items() if entry_kind(e) == MLP}
    blocks = [b for b in model_blocks(model) if b in entries]
    if len(blocks) != len(entries):
        unknown = sorted(set(entries) - set(blocks))
        raise ReplacementError(f"{lut_dir}: blocks {unknown} are not MLP blocks of the model")
    enc_w, enc_b, decs, dec_b, skips = [], [], [], [], []
    for t, block in enumerate(blocks):
        tensors = load_layer_file(os.path.join(lut_dir, entries[block]["file"]))
        sources = entries[block].get("sources", [block])
        missing = [s for s in sources if s not in blocks[: t + 1]]
        if missing:
            raise ReplacementError(
                f"{lut_dir}: {block} reads the codes of {missing}, not blocks at or below it in this LUT"
            )
        rows = tensors["precomputed_products"].split(n)
        decs.append({blocks.index(s): w for s, w in zip(sources, rows, strict=True)})
        enc_w.append(tensors["encoder_weight"])
        enc_b.append(tensors["encoder_bias"])
        dec_b.append(tensors["bias_product"])
        skips.append(tensors.get("skip_weight"))
    return Replacement(tuple(blocks), enc_w, enc_b, decs, dec_b, k, None, skips)


def load_replacement(model, dictionary, *, rule: str = "topk", k: int | None = None) -> Replacement:
    """The replacement ``dictionary`` gives ``model``, whatever it is: a ``Replacement``; a
    cross-layer transcoder (the module, or its file or directory: ours, circuit-tracer's
    ``W_enc_{l}``/``W_dec_{l}`` files, sparsify's cross-layer run); per-layer transcoders
    (``{block: transcoder}``, a sequence of files recording their blocks, one such file,
    circuit-tracer's transcoder set directory, a sparsify run of per-layer transcoders);
    a LUT directory (``lut/metadata.json``). ``rule``: "topk" (the top ``k``, the
    dictionary's unless given) or "threshold" (its JumpReLU thresholds: a calibrated CLT,
    circuit-tracer's transcoders; refused where none are held, saying what to do)."""
    from ..sae.architectures import CrossLayerTranscoder

    _check_rule(rule)
    if isinstance(dictionary, Replacement):
        if dictionary.rule != rule:
            raise ReplacementError(f"the replacement encodes by {dictionary.rule}, not {rule}")
        return dictionary
    if isinstance(dictionary, str | os.PathLike):
        if _is_lut(dictionary):
            if rule != "topk":
                raise ReplacementError(
                    f"{dictionary}: rule {rule!r}: a LUT holds no JumpReLU thresholds (its codes "
                    "are the top k); use rule='topk'"
                )
            return lut_replacement(model, dictionary)
        per_layer = _per_layer_files(model, dictionary)
        if per_layer is not None:
            return transcoder_replacement(model, per_layer, rule=rule, k=k)
        return clt_replacement(model, dictionary, rule=rule, k=k)
    if isinstance(dictionary, CrossLayerTranscoder):
        return clt_replacement(model, dictionary, rule=rule, k=k)
    return transcoder_replacement(model, dictionary, rule=rule, k=k)


def _per_layer_files(model, path: str | os.PathLike):
    """The per-layer transcoders the path ``path`` holds, as ``transcoder_replacement``
    takes them (``{block or hook point: file}``, or ``[file]``), or None for a CLT:
    circuit-tracer's transcoder set (its config's hooks, else layer l the model's l-th
    block), a sparsify run of per-layer transcoders (each directory named by its hook
    point), or one transcoder file or directory."""
    from ..sae import clt_interop
    from ..sae.ecosystem import sparsify_transcoders

    if os.path.isdir(path) and clt_interop.detect(Path(path)) == clt_interop.CIRCUIT_TRACER_SET:
        files, (hooks, _), _ = clt_interop.transcoder_set_files(Path(path))
        if not hooks:  # no config: layer l is the model's l-th block, every one of them
            blocks = model_blocks(model)
            if len(files) != len(blocks):
                raise ReplacementError(
                    f"{path}: {len(files)} transcoders and no config.yaml naming their hooks, so "
                    f"they must be the model's {len(blocks)} MLP blocks, layer l the l-th"
                )
            hooks = blocks
        return dict(zip(hooks, files, strict=True))
    found = sparsify_transcoders(path)
    if found:
        return found
    return [path] if _architecture(path) in ("transcoder", "skip_transcoder") else None


def _architecture(path: str | os.PathLike) -> str | None:
    """A dictionary file's or directory's architecture, from its metadata or config alone
    (no tensor read); None when it says none."""
    import json

    from ..format import SafetensorsFile
    from ..sae import clt_interop

    path = Path(path)
    if path.is_dir():
        cfg = path / "cfg.json"
        if cfg.is_file() and (path / "sae.safetensors").is_file():
            try:
                doc = json.loads(cfg.read_text())
            except (OSError, ValueError):
                return None
            if isinstance(doc, dict) and doc.get("transcode") and not doc.get("n_targets"):
                return "skip_transcoder" if doc.get("skip_connection") else "transcoder"
        path = path / "sae.safetensors"
    if not path.is_file():
        return None
    if clt_interop.is_ct_transcoder(path):
        return "transcoder"
    try:
        with SafetensorsFile(path) as f:
            return (f.metadata or {}).get("architecture")
    except OSError:
        return None


def _is_lut(path: str | os.PathLike) -> bool:
    """A LUT directory: its ``metadata.json`` names ``sae_config`` and ``layers``."""
    import json

    from ..lut.spec import METADATA

    try:
        with open(os.path.join(path, METADATA)) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and {"sae_config", "layers"} <= set(meta)


def block_layers(model, blocks: Sequence[str]) -> list[int]:
    """The model's layer index of each MLP block (``model_blocks``' order; a block in any
    convention ``block_of`` reads)."""
    known = model_blocks(model)
    return [known.index(b) for b in _resolved("blocks", blocks, known)]


# --- running it --------------------------------------------------------------------------


@dataclass
class Trace:
    """What one forward pass saw at each replaced block (``[batch, seq, ...]``, filled when
    recording): its ``inputs``, the block's own ``outputs`` on those inputs, the
    replacement's output ``replaced`` (y_hat) and the dense ``codes``."""

    inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)
    replaced: dict[str, torch.Tensor] = field(default_factory=dict)
    codes: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class ReplacementRun:
    """One forward pass: the logits and the trace."""

    logits: torch.Tensor
    trace: Trace


class ReplacementModel:
    """``model`` (a causal LM, left untouched outside ``hooked``) with its MLP blocks
    ``replacement.blocks`` replaced (module docstring). The replacement is moved to the
    model's device."""

    def __init__(self, model, replacement: Replacement, tokenizer=None):
        self.model = model
        self.tokenizer = tokenizer
        device = next(model.parameters()).device
        self.replacement = replacement.to(device)
        self.blocks = replacement.blocks
        modules = dict(model.named_modules())
        missing = [b for b in self.blocks if b not in modules]
        if missing:
            raise ReplacementError(f"the model has no modules {missing}")
        self._modules = [modules[b] for b in self.blocks]
        #: The model's layer index of each replaced block.
        self.layers = block_layers(model, self.blocks)

    @classmethod
    def load(
        cls, model_dir: str | os.PathLike, dictionary, *, rule: str = "topk", k: int | None = None
    ) -> ReplacementModel:
        """A local Hugging Face causal LM directory (offline, eval mode, weights frozen;
        ``tokenizer`` set) replaced by ``dictionary`` (anything ``load_replacement``
        takes, with its ``rule`` and ``k``)."""
        from ..extract.model import load_model

        tokenizer, model = load_model(model_dir)
        for p in model.parameters():
            p.requires_grad_(False)
        return cls(model, load_replacement(model, dictionary, rule=rule, k=k), tokenizer)

    def capture(self, tokens, first_position: bool = True):
        """The frozen local replacement model of one prompt (``tokens [P]``, token ids as a
        tensor, array or list): ``local.py``; ``first_position=False``: circuit-tracer's
        convention, no nodes at position 0."""
        from .local import capture

        return capture(self, torch.as_tensor(tokens, dtype=torch.long), first_position)

    @contextmanager
    def hooked(
        self, *, replace: bool = True, where: torch.Tensor | None = None, record: bool = False,
        edit=None, add: Sequence[torch.Tensor] | None = None,
    ):  # fmt: skip
        """Hooks for every forward pass inside: the codes computed from each block's input;
        with ``replace`` the block's output becomes ``y_hat`` at the positions ``where``
        (``[batch, seq]`` bool; None = all), else the model runs clean (the codes of clean
        inputs). ``edit(layer, code)`` may change a layer's code (``[batch * seq, n]``)
        before it is decoded; ``add[layer]`` is added to its ``y_hat`` (an error term).
        Yields the ``Trace`` of the last forward pass (filled when ``record``)."""
        trace, codes, handles = Trace(), [], []

        def hook(layer: int):
            def post(module, args, output):
                x, y = args[0], output[0] if isinstance(output, tuple) else output
                if layer == 0:
                    codes.clear()  # a new forward pass
                if len(codes) != layer:
                    raise ReplacementError(f"{self.blocks[layer]} ran before the blocks below it")
                flat = x.reshape(-1, x.shape[-1])
                code = self.replacement.encode(layer, flat)
                codes.append(code if edit is None else edit(layer, code))
                y_hat = self.replacement.decode(layer, codes, flat).reshape(y.shape).to(y.dtype)
                if add is not None:
                    y_hat = y_hat + add[layer].to(y.dtype)
                if record:
                    block = self.blocks[layer]
                    trace.inputs[block], trace.outputs[block] = x.detach(), y.detach()
                    trace.replaced[block] = y_hat
                    trace.codes[block] = codes[-1].reshape(*x.shape[:-1], -1)
                if not replace:
                    return None
                new = (
                    y_hat if where is None else torch.where(where.to(y.device)[..., None], y_hat, y)
                )
                return (new, *output[1:]) if isinstance(output, tuple) else new

            return post

        try:
            for layer, module in enumerate(self._modules):
                handles.append(module.register_forward_hook(hook(layer)))
            yield trace
        finally:
            for handle in handles:
                handle.remove()

    @torch.no_grad()
    def forward(self, batch: Mapping[str, torch.Tensor], *, replace: bool = True,
                where: torch.Tensor | None = None, record: bool = False) -> ReplacementRun:  # fmt: skip
        """One forward pass of ``batch`` (the model's inputs) under ``hooked``."""
        with self.hooked(replace=replace, where=where, record=record) as trace:
            logits = self.model(**batch).logits
        return ReplacementRun(logits, trace)

    __call__ = forward
