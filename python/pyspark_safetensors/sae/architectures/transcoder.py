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
Training follows sparsify's transcoders where they differ from an SAE, each measured
on synthetic MLP-like pairs (``benchmarks/bench_sae_quality.py``'s ``synthetic_pairs``,
d = 64, 512 latents, k = 8, 64 steps of 512; held-out FVU of the target):

- the decoder starts at zero (random unit rows: 0.54 against 0.45), so each latent
  starts writing the output direction its first tokens ask for;
- its rows keep no unit norm (no renormalisation, no projection of the gradient): a
  latent's output scale is its own, not the encoder's to carry. With unit rows 0.45 and
  48 % of the latents dead; without, 0.30 and 18 % (sparsify: 0.36, 19 %);
- the default learning rate is half an SAE's (``config.TRANSCODER_LR_SCALE``): 0.28 and
  1.4 % dead at half, 0.30 at the SAE's, 0.39 at a quarter; at d = 128 with 1,024
  latents 0.38 at half against 0.44 (sparsify 0.52); above d = 128 it falls further,
  as 1 / sqrt(d) (``config.TRANSCODER_LR_WIDTH``: at d = 384 0.44 against 0.79);
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

    def encoder_input(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.encoder_weight.dtype)

    def normalize_decoder(self) -> None:
        """Nothing: a transcoder's decoder rows keep their own norms (module docstring)."""

    def remove_parallel_gradient(self) -> None:
        """Nothing: no unit-norm constraint to keep."""

    @torch.no_grad()
    def center_encoder(self, mean_x: torch.Tensor) -> None:
        """``b_enc = -W_enc mean(x)``: the pre-activations start centred on the data, as an
        SAE's are by ``x - b_dec`` (sparsify initialises its transcoders so). Each rank
        sets its own latents' biases."""
        self.encoder_bias.copy_(-(self.encoder_weight @ mean_x.to(self.encoder_weight)))

    def metadata(self) -> dict[str, str]:
        return super().metadata() | {"d_in": str(self.d), "d_out": str(self.d_out)}


class SkipTranscoderSAE(TranscoderSAE):
    """A transcoder with a dense linear path ``x W_skip^T`` beside the sparse one."""

    ARCHITECTURE = "skip_transcoder"

    def _extra_parameters(self) -> dict[str, torch.Tensor]:
        return {"skip_weight": torch.zeros(self.d_out, self.d)}

    def placement(self, name: str) -> DimMap:
        return SKIP_PLACEMENT if name == "skip_weight" else super().placement(name)

    def skip(self, x: torch.Tensor) -> torch.Tensor:
        """The linear path ``x W_skip^T`` ``[B, d_out]`` (the same on every rank)."""
        return x.to(self.skip_weight.dtype) @ self.skip_weight.t()

    def _output(self, x, vals, idx, aux_vals, aux_idx) -> SAEOutput:
        # after the decode's reduction over "model": added once, not once per model rank
        y_hat = self.decode(vals, idx)
        return SAEOutput(y_hat + self.skip(x).to(y_hat.dtype), vals, idx, aux_vals, aux_idx)

    def full_shapes(self) -> dict[str, tuple[int, ...]]:
        return super().full_shapes() | {"skip_weight": (self.d_out, self.d)}
