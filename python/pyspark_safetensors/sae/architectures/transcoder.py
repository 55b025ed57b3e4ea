"""Transcoders (Dunefsky et al. 2024; sparsify's ``transcode=True``): a sparse code read
from one hook point that reconstructs another, typically an MLP block's input and output,
so the code replaces the whole block. Skip transcoders (Paulo et al. 2025; sparsify's
``skip_connection=True``) add a dense linear path:

    pre = W_enc x + b_enc                      (x uncentred: b_dec lives in the output space)
    z = TopK(ReLU(pre))                        (k latents per row, as ``TopKSAE``)
    y_hat = z W_dec + b_dec (+ x W_skip^T)     W_skip: skip_weight [d_out, d_in]

The tensors are the SAE's with ``encoder_weight [n, d_in]`` and ``decoder_weight
[n, d_out]``, plus ``skip_weight [d_out, d_in]`` for the skip variant. On a mesh the
latents shard on "model" as an SAE's do; ``skip_weight`` is replicated and added once,
after the model ranks' partial decodes are summed, so every model rank holds the same
``y_hat`` and the same ``skip_weight`` gradient (averaged over "data" like every other).

**Training steps about the inputs' mean.** An MLP's input has a large mean (the
residual stream's), and a weight reading ``x`` gets the gradient ``g x^T``: the part of
each step along ``mean(x)`` moves the latent's pre-activation alike for every token, so
the latents that fire first climb above the rest everywhere and the others never fire.
The trainer therefore steps the centred form ``W (x - mu) + b'`` (``mu = input_mean``,
the training inputs' mean): ``before_update`` takes ``g_b mu`` off each weight's
gradient and ``after_update`` moves its bias by ``-(W_new - W_old) mu``. The stored form
stays ``W x + b`` (what every reader of the file, the LUT included, expects) while the
steps are those of the centred one (a test checks them against a centred twin). The
skip path is stepped the same way, its constant part in ``b_dec``. On synthetic
MLP-like pairs (``benchmarks/bench_sae_quality.py``'s ``synthetic_pairs``; held-out FVU
of the target) at d = 384, 3,072 latents, k = 32, 64 steps of 4,096: 0.17 with no
latent dead, against 0.92 and 62 % dead stepping ``x`` itself (sparsify, which does:
0.45, 19 % dead); at d = 768, 16,384 latents, 128 steps: 0.11 against the uncentred
steps' 0.60 (sparsify 0.41).

With that, an SAE's learning rate suits a transcoder at every width measured (half of
it gave 0.26, 0.29 and 0.22 at d = 64, 128 and 384, against 0.25, 0.24 and 0.17; at
d = 768 a fifth of it gave 0.15, twice it 0.14, against 0.11). The rest follows
sparsify's transcoders where they differ from an SAE (d = 384 as above):

- the decoder starts at zero (random unit rows: 0.195), so each latent starts writing
  the output direction its first tokens ask for;
- its rows keep no unit norm (no renormalisation, no projection of the gradient): a
  latent's output scale is its own, not the encoder's to carry (unit rows: 0.194);
- ``skip_weight`` starts at zero, and the trainer starts ``b_enc`` at ``-W_enc mean(x)``
  (``center_encoder``) so that the uncentred input's mean does not bias which latents
  fire.
"""

from __future__ import annotations

import torch

from ..mesh import DimMap
from .base import SAEOutput
from .topk import TopKSAE

#: The skip path is replicated on every rank.
SKIP_PLACEMENT = DimMap({})


class TranscoderSAE(TopKSAE):
    """A TopK transcoder from ``d`` inputs to ``d_out`` outputs; the LUT's per-row top-k
    reproduces its code exactly."""

    ARCHITECTURE = "transcoder"
    TIED_INIT = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        with torch.no_grad():
            self.decoder_weight.zero_()  # the first step writes it (module docstring)
        # the inputs' mean the training steps are taken about (module docstring); a
        # buffer, so it rides in the trainer's state and never in the SAE's file
        self.register_buffer("input_mean", torch.zeros(self.d, device=self.encoder_weight.device))
        self._shifts: list[torch.Tensor | None] = []  # W mu before the step, per pair

    def encoder_input(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.encoder_weight.dtype)

    @torch.no_grad()
    def center_encoder(self, mean_x: torch.Tensor) -> None:
        """Record ``mean(x)`` as ``input_mean`` and set ``b_enc = -W_enc mean(x)``: the
        pre-activations start centred on the data, as an SAE's are by ``x - b_dec``
        (sparsify initialises its transcoders so). Each rank sets its own latents' biases."""
        self.input_mean.copy_(mean_x.to(self.input_mean))
        self.encoder_bias.copy_(-(self.encoder_weight @ self.input_mean))

    def _centred_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The (weight, bias) pairs that read ``x``: the bias absorbs ``-weight mean(x)``."""
        return [(self.encoder_weight, self.encoder_bias)]

    @torch.no_grad()
    def before_update(self) -> None:
        """Turn each weight's gradient into its gradient about ``input_mean``:
        ``g_W (x - mu) = g_W x - g_b mu``, and remember ``W mu`` for ``after_update`` (in
        place of an SAE's unit-norm hooks: a transcoder's decoder rows keep their norms)."""
        mu = self.input_mean
        self._shifts = []
        for w, b in self._centred_pairs():
            stepped = w.grad is not None and b.grad is not None
            if stepped:
                w.grad.addr_(b.grad.to(w.grad), mu.to(w.grad), alpha=-1)
            self._shifts.append(w @ mu if stepped else None)

    @torch.no_grad()
    def after_update(self) -> None:
        """Keep each weight's function about ``input_mean``: ``b -= (W_new - W_old) mu``."""
        for (w, b), before in zip(self._centred_pairs(), self._shifts, strict=False):
            if before is not None:
                b.sub_(w @ self.input_mean - before)
        self._shifts = []

    def metadata(self) -> dict[str, str]:
        return super().metadata() | {"d_in": str(self.d), "d_out": str(self.d_out)}


class SkipTranscoderSAE(TranscoderSAE):
    """A transcoder with a dense linear path ``x W_skip^T`` beside the sparse one."""

    ARCHITECTURE = "skip_transcoder"

    def _extra_parameters(self) -> dict[str, torch.Tensor]:
        return {"skip_weight": torch.zeros(self.d_out, self.d)}

    def placement(self, name: str) -> DimMap:
        return SKIP_PLACEMENT if name == "skip_weight" else super().placement(name)

    def _centred_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        # the skip path reads x too, and its constant part is the decoder bias
        return [*super()._centred_pairs(), (self.skip_weight, self.decoder_bias)]

    def skip(self, x: torch.Tensor) -> torch.Tensor:
        """The linear path ``x W_skip^T`` ``[B, d_out]`` (the same on every rank)."""
        return x.to(self.skip_weight.dtype) @ self.skip_weight.t()

    def _output(self, x, vals, idx, aux_vals, aux_idx) -> SAEOutput:
        # after the decode's reduction over "model": added once, not once per model rank
        y_hat = self.decode(vals, idx)
        return SAEOutput(y_hat + self.skip(x).to(y_hat.dtype), vals, idx, aux_vals, aux_idx)

    def full_shapes(self) -> dict[str, tuple[int, ...]]:
        return super().full_shapes() | {"skip_weight": (self.d_out, self.d)}
