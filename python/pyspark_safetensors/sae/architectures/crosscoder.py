"""Crosscoders (Lindsey et al. 2024, "Sparse Crosscoders for Cross-Layer Features and
Model Diffing"; as llamascopium trains them): one sparse code read from several hook
points at once that reconstructs all of them. With ``L`` hook points of width ``d``,
``x = y = concat(a_1, ..., a_L) [B, L d]``; the decoder's columns are ``L`` blocks, one
per hook point:

    z = TopK(ReLU(W_enc (x - b_dec) + b_enc)),    y_hat_l = z W_dec^(l) + b_dec^(l)

The decoder constraint is on the sum of a latent's block norms: ``sum_l |W_dec^(l)_i|
= 1`` (the norm the crosscoder paper weights its sparsity penalty with), not a unit norm
per block. A per-block unit norm would make every latent write with the same strength
into every hook point, so a feature present at one layer only could not exist; the sum
lets a latent concentrate its norm in the layers where it lives, and keeps the latents'
total decoder norms equal so that the top-k compares their values fairly. The trainer's
step renormalises each row to that sum and first removes the gradient's component that
changes it (``d/dw sum_l |w_l| = (w_1/|w_1|, ..., w_L/|w_L|)``).

Held-out evaluation reports each hook point's FVU (``fvu_<hook point>``). The LUT job
refuses a crosscoder: its code is read from several hook points at once.
"""

from __future__ import annotations

import json

import torch

from ...format.errors import InvalidArgumentError
from .base import TINY, SAEOutput
from .topk import TopKSAE


class CrosscoderSAE(TopKSAE):
    """A TopK crosscoder over ``blocks`` hook points of width ``d // blocks`` each
    (``hook_points`` names them, in block order)."""

    ARCHITECTURE = "crosscoder"
    LUT_REFUSAL = (
        "a crosscoder reads several hook points at once (its code needs all of them), so "
        "no single layer's input can be looked up"
    )

    def __init__(self, d: int, n_latents: int, k: int, *, blocks: int = 2, hook_points=(),
                 **kwargs):  # fmt: skip
        if blocks < 1 or d % blocks:
            raise InvalidArgumentError(
                f"a crosscoder's width {d} does not split into {blocks} blocks"
            )
        super().__init__(d, n_latents, k, **kwargs)
        self.blocks = blocks
        self.hook_points = tuple(hook_points)
        self.normalize_decoder()

    @classmethod
    def config_options(cls, config) -> dict:
        return {"blocks": len(config.datasets) or 2}

    @classmethod
    def stored_options(cls, metadata: dict) -> dict:
        hooks = metadata.get("hook_points")
        hooks = json.loads(hooks) if isinstance(hooks, str) else list(hooks or [])
        return {"blocks": int(metadata.get("blocks") or len(hooks)), "hook_points": tuple(hooks)}

    @property
    def block_names(self) -> list[str]:
        """Each block's name: its hook point, or ``block<i>`` where none is recorded."""
        hooks = list(self.hook_points)
        if len(hooks) == self.blocks and all(hooks) and len(set(hooks)) == self.blocks:
            return hooks
        return [f"block{i}" for i in range(self.blocks)]

    def _blockwise(self, w: torch.Tensor) -> torch.Tensor:
        return w.view(w.shape[0], self.blocks, -1)

    @torch.no_grad()
    def normalize_decoder(self) -> None:
        """Each row divided by the sum of its blocks' norms."""
        w = self.decoder_weight
        total = self._blockwise(w).norm(dim=2).sum(1, keepdim=True)
        w /= total.clamp_min(TINY)

    @torch.no_grad()
    def remove_parallel_gradient(self) -> None:
        """Drop the gradient's component that changes a row's sum of block norms."""
        w, g = self.decoder_weight, self.decoder_weight.grad
        if g is None:
            return
        blocks = self._blockwise(w)
        u = (blocks / blocks.norm(dim=2, keepdim=True).clamp_min(TINY)).reshape(w.shape)
        g -= (g * u).sum(1, keepdim=True) / (u * u).sum(1, keepdim=True).clamp_min(TINY) * u

    def split(self, t: torch.Tensor) -> list[torch.Tensor]:
        """``[B, L d]`` cut into the hook points' ``[B, d]`` blocks."""
        return list(t.chunk(self.blocks, dim=1))

    def evaluation_parts(self, out: SAEOutput, y: torch.Tensor) -> dict:
        hats, parts = self.split(out.x_hat), self.split(y)
        return {
            name: (hat, part) for name, hat, part in zip(self.block_names, hats, parts, strict=True)
        }

    def metadata(self) -> dict[str, str]:
        return super().metadata() | {
            "blocks": str(self.blocks),
            "hook_points": json.dumps(list(self.hook_points)),
        }
