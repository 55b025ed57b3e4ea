"""The local replacement model of one prompt (Ameisen et al. 2025, "Circuit Tracing"): the
replacement model's frozen mode, on which attribution graphs are made.

A causal LM of the Llama family (RMSNorm, attention without biases, an ``mlp`` per
block) runs the prompt once (``capture``, or ``ReplacementModel.capture``); then every
replaced MLP block is the replacement's output plus an **error** (the block's true output
minus the replacement's, a constant of the prompt), and the attention patterns and the
normalisations' scales ``1 / rms(h)`` are frozen at those clean values. What is left is
linear in its sources (``LocalReplacement.run``):

    h_0 = sum_p  e_p * E[token_p]                         (embedding nodes, scale e_p = 1)
    h += A_l(h)           A_l: V, O projections of norm1 with the clean patterns and scale
    x_l = norm2_l(h)      the MLP input, read by layer l's features (pre = W_enc x_l + b_enc)
    h += sum_{s in sources(l)} a_f W_dec^{s->l}[latent_f] + b_dec^l (+ x_l W_skip^l^T)
         + r_{l,p} err_{l,p}
    logit_v = norm_f(h)[last] . W_U[v]

with the active features' activations ``a_f``, the error nodes' scales ``r`` (1) and
the embeddings' scales ``e`` (1) as the sources. At the clean sources it reproduces the
model's MLP inputs and logits (``check_exact``, run by ``capture``; a model outside this
family fails it instead of giving wrong edges).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .errors import ReplacementError

#: How far the frozen model at its clean sources may differ from the model (relative to
#: the largest magnitude compared) before ``capture`` refuses the model.
EXACT_RTOL = 1e-4


@dataclass
class Features:
    """The active features of a prompt: replacement layer, model layer, position, latent,
    value."""

    layer: torch.Tensor  # [F] the replacement's layer (index into Replacement.blocks)
    model_layer: torch.Tensor  # [F] the model's block index
    pos: torch.Tensor  # [F]
    latent: torch.Tensor  # [F]
    value: torch.Tensor  # [F] the activation

    def __len__(self) -> int:
        return len(self.value)

    def subset(self, index: torch.Tensor) -> Features:
        """The features at ``index``."""
        return Features(self.layer[index], self.model_layer[index], self.pos[index],
                        self.latent[index], self.value[index])  # fmt: skip


@dataclass
class LocalReplacement:
    """One prompt's clean run and its frozen linear model (module docstring)."""

    replacement_model: object  # the ReplacementModel it was captured from
    tokens: torch.Tensor  # [P]
    embeddings: torch.Tensor  # [P, d]
    patterns: list[torch.Tensor]  # per block [H, P, P]
    scales: list[tuple[torch.Tensor, torch.Tensor]]  # per block (norm1, norm2) [P, 1]
    final_scale: torch.Tensor  # [P, 1]
    mlp_in: list[torch.Tensor]  # per block [P, d]
    mlp_out: list[torch.Tensor]  # per block [P, d]
    logits: torch.Tensor  # [P, V] the model's
    codes: dict[int, torch.Tensor]  # replacement layer -> dense code [P, n_l]
    errors: torch.Tensor  # [n_blocks, P, d]
    fixed: torch.Tensor | None = None  # [n_blocks, P, d] block outputs of no node (capture)
    first_errors: torch.Tensor | None = None  # [n_blocks, d] position 0's when fixed
    features: Features = field(init=False)
    block_of_layer: list[int] = field(init=False)  # replacement layer -> model block
    _rows: tuple | None = field(init=False, default=None, repr=False)

    def __post_init__(self):
        self.block_of_layer = list(self.replacement_model.layers)
        found = [(layer, c.nonzero(), c) for layer, c in sorted(self.codes.items())]
        # nonzero is row-major: features sorted by (layer, position, latent)
        layer = torch.cat([torch.full((len(nz),), a, dtype=torch.long) for a, nz, _ in found])
        pos = torch.cat([nz[:, 0] for _, nz, _ in found])
        latent = torch.cat([nz[:, 1] for _, nz, _ in found])
        value = torch.cat([c[nz[:, 0], nz[:, 1]] for _, nz, c in found]).float()
        blocks = torch.tensor(self.block_of_layer, dtype=torch.long)
        self.features = Features(layer, blocks[layer], pos, latent, value)

    @property
    def model(self):
        return self.replacement_model.model

    @property
    def replacement(self):  # the Replacement
        return self.replacement_model.replacement

    @property
    def n_blocks(self) -> int:
        return len(self.mlp_in)

    @property
    def n_pos(self) -> int:
        return len(self.tokens)

    def run(
        self,
        values: torch.Tensor,
        error_scale: torch.Tensor,
        embed_scale: torch.Tensor,
        features: Features | None = None,
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The frozen model on a batch of sources: ``values [B, F]`` of ``features``
        (default: the prompt's active ones), ``error_scale [B, n_blocks, P]``,
        ``embed_scale [B, P]``. Returns every block's MLP input ``[B, P, d]`` and the
        last position's final-normed residual ``[B, d]``."""
        feats = self.features if features is None else features
        parts = _parts(self.model)
        h = embed_scale[..., None] * self.embeddings
        xs = []
        for i, block in enumerate(parts.layers):
            s1, s2 = self.scales[i]
            h = h + _frozen_attention(block.self_attn, h * s1 * block.input_layernorm.weight,
                                      self.patterns[i])  # fmt: skip
            xs.append(h * s2 * block.post_attention_layernorm.weight)
            h = (
                h
                + error_scale[:, i, :, None] * self.errors[i]
                + self._written(i, values, feats, xs[-1])
            )
            if self.fixed is not None:
                h = h + self.fixed[i]
        final = h[:, -1] * self.final_scale[-1] * parts.norm.weight
        return xs, final

    def _written(self, block: int, values: torch.Tensor, feats: Features,
                 x: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """What the replacement writes into block ``block``'s output ``[B, P, d]`` (its
        skip path from the block's input ``x [B, P, d]`` too)."""
        B, P = values.shape[0], self.n_pos
        if block not in self.block_of_layer:
            return torch.zeros(B, P, self.embeddings.shape[1])
        t = self.block_of_layer.index(block)
        rep = self.replacement
        out = rep.decoder_bias[t].expand(B, P, -1)
        for s in rep.sources(t):
            sel = (feats.layer == s).nonzero()[:, 0]
            if len(sel):
                decoder = rep.decoder(s, t)  # [n_s, d]: the code of layer s, dense, decoded
                n = len(decoder)
                code = torch.zeros(B, P * n, dtype=values.dtype)
                code = code.index_copy(1, feats.pos[sel] * n + feats.latent[sel], values[:, sel])
                out = out + code.view(B, P, n) @ decoder
        if rep.skip[t] is not None:
            out = out + x @ rep.skip[t].t()
        return out

    def gradients(self, batch: int) -> Gradients:
        """The frozen model's linear part, run once for ``batch`` rows so that a backward
        pass per batch of targets gives each target's gradient at every block output and
        at the embeddings (``Gradients.of``)."""
        parts = _parts(self.model)
        B, (P, d) = batch, self.embeddings.shape
        # its values do not matter (the model is linear in h): zeros, with a leaf added at
        # the embeddings and after every block's MLP to read the gradient there
        taps = [torch.zeros(B, P, d, requires_grad=True) for _ in range(self.n_blocks + 1)]
        h, xs = taps[-1], []
        skips = {b: self.replacement.skip[t] for t, b in enumerate(self.block_of_layer)}
        with torch.enable_grad():
            for i, block in enumerate(parts.layers):
                s1, s2 = self.scales[i]
                h = h + _frozen_attention(block.self_attn, h * s1 * block.input_layernorm.weight,
                                          self.patterns[i])  # fmt: skip
                xs.append(h * s2 * block.post_attention_layernorm.weight)
                if skips.get(i) is not None:
                    h = h + xs[-1] @ skips[i].t()
                h = h + taps[i]
            final = h[:, -1] * self.final_scale[-1] * parts.norm.weight
        return Gradients(xs, final, taps)

    def clean_sources(self, batch: int = 1) -> tuple[torch.Tensor, ...]:
        """The clean sources, ``batch`` copies: (values, error scales, embedding scales)."""
        return (
            self.features.value.expand(batch, -1).clone(),
            torch.ones(batch, self.n_blocks, self.n_pos),
            torch.ones(batch, self.n_pos),
        )

    def pre_activations(self, xs: list[torch.Tensor], feats: Features | None = None):
        """Each feature's pre-activation ``W_enc x + b_enc`` from ``run``'s inputs ``[B, F]``."""
        feats = self.features if feats is None else feats
        w, b = self.encoder_rows(feats)
        x = torch.stack([xs[int(b)][:, int(p)] for b, p in zip(feats.model_layer, feats.pos, strict=True)], 1) \
            if len(feats) else torch.zeros(xs[0].shape[0], 0, w.shape[1])  # fmt: skip
        return (x * w).sum(-1) + b

    def encoder_rows(self, feats: Features | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Each feature's encoder row ``[F, d]`` and bias ``[F]`` (the prompt's features'
        gathered once: every batch of attribution targets reads them)."""
        if feats is None:
            if self._rows is None:
                self._rows = self.encoder_rows(self.features)
            return self._rows
        rep = self.replacement
        w = torch.zeros(len(feats), rep.encoder_weight[0].shape[1])
        b = torch.zeros(len(feats))
        for layer in feats.layer.unique().tolist():
            sel = feats.layer == layer
            w[sel] = rep.encoder_weight[layer][feats.latent[sel]]
            b[sel] = rep.encoder_bias[layer][feats.latent[sel]]
        return w, b

    def check_exact(self) -> float:
        """The largest relative difference between the frozen model at its clean sources
        and the model (MLP inputs, last logits); raises ``ReplacementError`` above
        ``EXACT_RTOL``."""
        with torch.no_grad():
            xs, final = self.run(*self.clean_sources())
            logits = _parts(self.model).head(final)[0]
        worst = 0.0
        for got, want in [
            *zip((x[0] for x in xs), self.mlp_in, strict=True),
            (logits, self.logits[-1]),
        ]:
            scale = want.abs().max().clamp_min(1e-6)
            worst = max(worst, float((got - want).abs().max() / scale))
        if worst > EXACT_RTOL:
            raise ReplacementError(
                f"the frozen replacement model misses the model by {worst:.2e} (relative): "
                "an architecture outside the Llama family (norm or attention biases?)"
            )
        return worst


@dataclass
class Gradients:
    """``LocalReplacement.gradients``' retained forward: the MLP inputs ``xs`` and the
    final residual ``[B, d]`` of the linear part, and its taps (every block's output, then
    the embeddings), each ``[B, P, d]``."""

    xs: list[torch.Tensor]
    final: torch.Tensor
    taps: list[torch.Tensor]

    def of(self, inject: dict[int, torch.Tensor], final: torch.Tensor | None,
           last: bool = False) -> list[torch.Tensor]:  # fmt: skip
        """Row b's gradient at every tap (``[B, P, d]`` each; zero where none reaches) of
        ``sum_l <inject[l], xs[l]> + <final, self.final>``: ``inject[l]`` ``[B, P, d]`` at
        block l's MLP input, ``final`` ``[B, d]``. ``last``: the forward is not needed
        again (its graph is freed)."""
        outputs = [self.xs[layer] for layer in inject] + ([self.final] if final is not None else [])
        grads = [*inject.values()] + ([final] if final is not None else [])
        got = torch.autograd.grad(outputs, self.taps, grads, retain_graph=not last,
                                  allow_unused=True)  # fmt: skip
        return [
            torch.zeros_like(t) if g is None else g for g, t in zip(got, self.taps, strict=True)
        ]


@dataclass(frozen=True)
class _Parts:
    layers: object
    embed: object
    norm: object
    lm_head: object

    def head(self, final: torch.Tensor) -> torch.Tensor:
        return self.lm_head(final)


def _parts(model) -> _Parts:
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(model, "lm_head"):
        raise ReplacementError(
            f"{type(model).__name__}: the local replacement model needs a Llama-style causal "
            "LM (model.layers, model.norm, lm_head)"
        )
    return _Parts(inner.layers, inner.embed_tokens, inner.norm, model.lm_head)


def _frozen_attention(attn, normed: torch.Tensor, pattern: torch.Tensor) -> torch.Tensor:
    """``o_proj(pattern @ v_proj(normed))`` per head, grouped-query heads repeated."""
    B, P, _ = normed.shape
    H = pattern.shape[0]
    v = attn.v_proj(normed).view(B, P, -1, attn.head_dim).transpose(1, 2)  # [B, Hkv, P, hd]
    v = v.repeat_interleave(H // v.shape[1], dim=1)
    out = (pattern @ v).transpose(1, 2).reshape(B, P, H * attn.head_dim)
    return attn.o_proj(out)


def _rms_scale(norm, h: torch.Tensor) -> torch.Tensor:
    return torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)


@torch.no_grad()
def capture(
    replacement_model, tokens: torch.Tensor, first_position: bool = True
) -> LocalReplacement:
    """Run ``tokens`` ``[P]`` through the replacement model's model (a Llama-style causal
    LM, eager attention) and freeze its local replacement model; checked exact
    (``check_exact``). ``first_position=False`` is circuit-tracer's convention: position 0
    (BOS, the attention sink) has no features and no error nodes, what its MLPs write is a
    constant of the prompt (``fixed``)."""
    model, rep = replacement_model.model, replacement_model.replacement
    parts = _parts(model)
    if getattr(model.config, "_attn_implementation", "eager") != "eager":
        model.set_attn_implementation("eager")  # the patterns come from eager attention
    seen: dict[str, torch.Tensor] = {}
    hooks = []

    def keep(name, what):
        def hook(module, args, output):
            seen[name] = (args[0] if what == "in" else output[1] if what == "pattern" else output)[
                0
            ]

        return hook

    for i, block in enumerate(parts.layers):
        hooks += [block.input_layernorm.register_forward_hook(keep(f"n1.{i}", "in")),
                  block.self_attn.register_forward_hook(keep(f"att.{i}", "pattern")),
                  block.post_attention_layernorm.register_forward_hook(keep(f"n2.{i}", "in")),
                  block.mlp.register_forward_hook(keep(f"in.{i}", "in")),
                  block.mlp.register_forward_hook(keep(f"out.{i}", "out"))]  # fmt: skip
    hooks.append(parts.norm.register_forward_hook(keep("nf", "in")))
    try:
        logits = model(input_ids=tokens[None]).logits[0]
    finally:
        for h in hooks:
            h.remove()
    n = len(parts.layers)
    blocks = replacement_model.layers
    codes = [rep.encode(t, seen[f"in.{b}"]) for t, b in enumerate(blocks)]
    errors = torch.stack([seen[f"out.{i}"] for i in range(n)])
    for t, b in enumerate(blocks):
        errors[b] -= rep.decode(t, codes, seen[f"in.{b}"])
    fixed = first_errors = None
    if not first_position:
        fixed = torch.zeros_like(errors)
        fixed[:, 0] = errors[:, 0]
        first, none = [c[:1] for c in codes], [torch.zeros_like(c[:1]) for c in codes]
        for t, b in enumerate(blocks):  # what position 0's features write, now a constant
            x = seen[f"in.{b}"][:1]
            fixed[b, 0] += (rep.decode(t, first, x) - rep.decode(t, none, x))[0]
        first_errors = errors[:, 0].clone()
        errors[:, 0] = 0
        codes = [torch.cat([torch.zeros_like(c[:1]), c[1:]]) for c in codes]
    local = LocalReplacement(
        replacement_model, tokens, parts.embed(tokens),
        [seen[f"att.{i}"] for i in range(n)],
        [(_rms_scale(b.input_layernorm, seen[f"n1.{i}"]),
          _rms_scale(b.post_attention_layernorm, seen[f"n2.{i}"])) for i, b in enumerate(parts.layers)],
        _rms_scale(parts.norm, seen["nf"]),
        [seen[f"in.{i}"] for i in range(n)], [seen[f"out.{i}"] for i in range(n)],
        logits, dict(enumerate(codes)), errors, fixed, first_errors,
    )  # fmt: skip
    local.check_exact()
    return local
