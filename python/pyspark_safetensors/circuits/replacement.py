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

``act_l`` keeps the top ``k`` of ``ReLU(pre)`` per row, or (a CLT's ``rule="threshold"``)
``pre * 1[pre > threshold]``. A CLT's ``sources(t)`` are the layers ``0..t``; a per-layer
transcoder's are ``{t}`` alone. ``load_replacement`` makes one of any of these.

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

import torch

from ..format.errors import InvalidArgumentError
from .errors import ReplacementError

RULES = ("topk", "threshold")
"""How a layer's latents are chosen at inference (``Replacement.encode``)."""


@dataclass
class Replacement:
    """What replaces the MLP blocks ``blocks`` (module names, in layer order), in float32:
    per layer ``l`` its encoder ``encoder_weight[l] [n_l, d_in]``, ``encoder_bias[l]``,
    ``k`` and optional ``threshold[l] [n_l]`` (the JumpReLU rule); per target ``t`` its
    decoders ``decoders[t] = {source l: W_dec^{l->t} [n_l, d_out]}``, ``decoder_bias[t]``
    and optional ``skip[t] [d_out, d_in]``."""

    blocks: tuple[str, ...]
    encoder_weight: list[torch.Tensor]
    encoder_bias: list[torch.Tensor]
    decoders: list[dict[int, torch.Tensor]]
    decoder_bias: list[torch.Tensor]
    k: int
    threshold: list[torch.Tensor] | None = None
    skip: list[torch.Tensor | None] = field(default_factory=list)

    def __post_init__(self):
        if not self.skip:
            self.skip = [None] * len(self.blocks)
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
    the extraction's ``mlp_layers`` rule)."""
    from ..extract.model import mlp_blocks

    blocks = mlp_blocks(model)
    spread = [b.layer for b in blocks if not b.module]
    if spread:
        raise ReplacementError(
            f"{type(model).__name__}: the MLP of layers {spread} is spread over modules (no one "
            "module is the whole block), which a replacement swaps whole"
        )
    return [b.module for b in blocks]


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
    """The model blocks a dictionary of ``n_layers`` layers replaces: those it records,
    checked against the model, else every block of the model."""
    blocks = model_blocks(model)
    if recorded:
        unknown = [b for b in recorded if b not in blocks]
        if unknown:
            raise ReplacementError(
                f"{where}: blocks {unknown} are not MLP blocks of the model ({blocks})"
            )
        if [b for b in blocks if b in recorded] != list(recorded):
            raise ReplacementError(f"{where}: blocks {list(recorded)} are not in layer order")
        return tuple(recorded)
    if n_layers != len(blocks):
        expected = (len(blocks), *shape[1:])
        raise ReplacementError(
            f"{where}: {tensor} has shape {list(shape)}; expected {list(expected)} (it names no "
            f"blocks, so it must cover the model's {len(blocks)} MLP blocks)"
        )
    return tuple(blocks)


def clt_replacement(model, clt, *, rule: str = "topk") -> Replacement:
    """The replacement a cross-layer transcoder (a ``CrossLayerTranscoder`` or a path
    ``load_sae_model`` reads) gives ``model``: its ``blocks`` (metadata) or, when it
    records none, every MLP block of the model. Refused, naming the tensor and the shape
    expected, when its layers or widths do not fit the model."""
    from ..sae.architectures import CrossLayerTranscoder
    from ..sae.architectures.clt import block_of
    from ..sae.ecosystem import load_sae_model

    if rule not in RULES:
        raise InvalidArgumentError(f"rule must be one of {RULES}, got {rule!r}")
    where = os.fspath(clt) if isinstance(clt, str | os.PathLike) else "the CLT"
    module = load_sae_model(clt) if isinstance(clt, str | os.PathLike) else clt
    if not isinstance(module, CrossLayerTranscoder):
        raise ReplacementError(f"{where}: a {type(module).__name__}, not a cross-layer transcoder")
    L, n, d = module.n_layers, module.n_latents, _hidden(model)
    shape = tuple(module.encoder_weight.shape)
    recorded = [block_of(h) for h in module.hook_points]
    blocks = _covered_blocks(model, where, recorded, L, "encoder_weight", shape)
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
        module.k,
        [f32(module.threshold[i]) for i in range(L)] if rule == "threshold" else None,
    )


def recorded_block(path: str | os.PathLike) -> str:
    """The MLP block a dictionary file records as its ``hook_point`` (in its metadata or
    its saved config), refused when it records none."""
    import json

    from ..sae.architectures.clt import block_of
    from ..sae.ecosystem import read_sae

    meta = read_sae(path)[1].get("metadata") or {}
    hook = meta.get("hook_point") or json.loads(meta.get("config", "{}")).get("hook_point")
    if not hook:
        raise ReplacementError(
            f"{path}: the file records no hook_point; give the transcoders as "
            "{block module name: file}"
        )
    return block_of(hook)


def transcoder_replacement(
    model, transcoders: Mapping[str, object] | Sequence[str | os.PathLike]
) -> Replacement:
    """The replacement a set of per-layer transcoders gives ``model``: ``{block module
    name: transcoder}`` (a ``TranscoderSAE``/``SkipTranscoderSAE`` or a path), or files
    that each record their ``hook_point``; each block decoded from its own code alone
    (the CLT's ``l -> l`` special case). They must share one ``k``."""
    from ..sae.ecosystem import load_sae_model

    if not isinstance(transcoders, Mapping):
        transcoders = {recorded_block(p): p for p in transcoders}
    blocks, d = model_blocks(model), _hidden(model)
    unknown = [b for b in transcoders if b not in blocks]
    if unknown:
        raise ReplacementError(f"transcoders for {unknown}: not MLP blocks of the model ({blocks})")
    ordered = [b for b in blocks if b in transcoders]
    enc_w, enc_b, decs, dec_b, skips, ks = [], [], [], [], [], set()
    for t, block in enumerate(ordered):
        tc = transcoders[block]
        where = os.fspath(tc) if isinstance(tc, str | os.PathLike) else f"the transcoder of {block}"
        tc = load_sae_model(tc) if isinstance(tc, str | os.PathLike) else tc
        if getattr(tc, "ARCHITECTURE", "") not in ("transcoder", "skip_transcoder"):
            raise ReplacementError(f"{where}: a {type(tc).__name__}, not a transcoder")
        state = tc.full_state()
        _fits(where, "encoder_weight", state["encoder_weight"].shape, (None, d),
              f"{block} reads {d}")  # fmt: skip
        _fits(where, "decoder_weight", state["decoder_weight"].shape,
              (state["encoder_weight"].shape[0], d), f"{block} writes {d}")  # fmt: skip
        enc_w.append(state["encoder_weight"].float())
        enc_b.append(state["encoder_bias"].float())
        decs.append({t: state["decoder_weight"].float()})
        dec_b.append(state["decoder_bias"].float())
        skips.append(state["skip_weight"].float() if "skip_weight" in state else None)
        ks.add(tc.k)
    if len(ks) != 1:
        raise ReplacementError(
            f"the transcoders disagree on k ({sorted(ks)}); a replacement has one"
        )
    return Replacement(tuple(ordered), enc_w, enc_b, decs, dec_b, ks.pop(), None, skips)


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


def load_replacement(model, dictionary, *, rule: str = "topk") -> Replacement:
    """The replacement ``dictionary`` gives ``model``, whatever it is: a ``Replacement``; a
    cross-layer transcoder (its file or directory, ours or a layout ``read_sae`` reads, or
    the module); per-layer transcoders (a sequence of files recording their hook points,
    or ``{block: transcoder}``); a LUT directory (``lut/metadata.json``). ``rule``:
    "topk" (every dictionary) or "threshold" (a CLT's JumpReLU thresholds)."""
    from ..sae.architectures import CrossLayerTranscoder

    if rule not in RULES:
        raise InvalidArgumentError(f"rule must be one of {RULES}, got {rule!r}")
    if isinstance(dictionary, Replacement):
        if dictionary.rule != rule:
            raise ReplacementError(f"the replacement encodes by {dictionary.rule}, not {rule}")
        return dictionary
    if isinstance(dictionary, str | os.PathLike) and _is_lut(dictionary):
        kind, made = "a LUT", lambda: lut_replacement(model, dictionary)
    elif isinstance(dictionary, str | os.PathLike | CrossLayerTranscoder):
        return clt_replacement(model, dictionary, rule=rule)
    else:
        kind, made = "per-layer transcoders", lambda: transcoder_replacement(model, dictionary)
    if rule != "topk":
        raise ReplacementError(
            f"rule {rule!r}: {kind} hold no JumpReLU thresholds (only a cross-layer "
            "transcoder calibrates them); use rule='topk'"
        )
    return made()


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
    """The model's layer index of each MLP block (``model_blocks``' order)."""
    known = model_blocks(model)
    missing = [b for b in blocks if b not in known]
    if missing:
        raise ReplacementError(f"blocks {missing} are not MLP blocks of the model ({known})")
    return [known.index(b) for b in blocks]


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
        cls, model_dir: str | os.PathLike, dictionary, *, rule: str = "topk"
    ) -> ReplacementModel:
        """A local Hugging Face causal LM directory (offline, eval mode, weights frozen;
        ``tokenizer`` set) replaced by ``dictionary`` (anything ``load_replacement``
        takes)."""
        from ..extract.model import load_model

        tokenizer, model = load_model(model_dir)
        for p in model.parameters():
            p.requires_grad_(False)
        return cls(model, load_replacement(model, dictionary, rule=rule), tokenizer)

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
