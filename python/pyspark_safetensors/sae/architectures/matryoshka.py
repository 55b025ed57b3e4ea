"""Matryoshka BatchTopK SAEs (Nabeshima 2024; Bussmann et al. 2025, "Learning
Multi-Level Features with Matryoshka SAEs"; SAELens' ``matryoshka_batchtopk``): nested
prefixes of the dictionary, latents ``[0, m_1) ⊂ [0, m_2) ⊂ ... ⊂ [0, n)``, each trained to
reconstruct on its own. The code is BatchTopK's over the whole dictionary; prefix ``m``
decodes only the code's latents below ``m``:

    y_hat_m = sum_{j: idx_j < m} v_j W_dec[idx_j] + b_dec

and the loss is the mean over the prefixes of each one's FVU (the mean, not the sum, so
that the learning rate calibrated on one FVU fits). Early latents must explain what they
can without the later ones, which cuts feature absorption and splitting. At inference it
is a BatchTopK SAE (a learned threshold), which the LUT's per-row top-k approximates.

On a mesh each rank decodes its own latents into one partial per bucket ``[m_{i-1},
m_i)``; the buckets are summed over "model" in one collective and accumulated into the
prefixes.
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F

from ...format.errors import InvalidArgumentError
from ..config import default_prefixes
from ..mesh import reduce_from_model
from .base import SAEOutput
from .batchtopk import BatchTopKSAE


class MatryoshkaSAE(BatchTopKSAE):
    """A BatchTopK SAE whose nested ``prefixes`` (ascending latent counts, the last
    ``n_latents``; default n/16, n/8, n/4, n/2, n) each learn to reconstruct."""

    ARCHITECTURE = "matryoshka"

    def __init__(self, d: int, n_latents: int, k: int, *, prefixes=(), **kwargs):
        super().__init__(d, n_latents, k, **kwargs)
        sizes = tuple(int(m) for m in prefixes) or default_prefixes(n_latents, k)
        if list(sizes) != sorted(set(sizes)) or sizes[-1] != n_latents or sizes[0] < 1:
            raise InvalidArgumentError(
                f"matryoshka prefixes must ascend strictly and end at n_latents "
                f"({n_latents}), got {list(sizes)}"
            )
        self.prefixes = sizes

    @classmethod
    def config_options(cls, config) -> dict:
        return {"prefixes": config.prefixes}

    @classmethod
    def stored_options(cls, metadata: dict) -> dict:
        stored = metadata.get("matryoshka_prefixes")
        return {"prefixes": tuple(json.loads(stored))} if stored else {}

    def prefix_decodes(self, values: torch.Tensor, indices: torch.Tensor) -> list[torch.Tensor]:
        """Each prefix's reconstruction of a code, in prefix order (the last is the whole
        dictionary's ``decode``)."""
        edges = torch.tensor(self.prefixes, device=indices.device)
        bucket = torch.bucketize(indices, edges, right=True)  # prefix i holds buckets <= i
        weight = self.decoder_weight
        local = indices - self.offset
        parts = torch.stack([
            F.embedding_bag(local, weight, mode="sum",
                            per_sample_weights=(values * (bucket == i)).to(weight.dtype))
            for i in range(len(self.prefixes))
        ])  # fmt: skip
        parts = reduce_from_model(parts, self.mesh).cumsum(0) + self.decoder_bias
        return list(parts.unbind(0))

    def _output(self, x, vals, idx, aux_vals, aux_idx) -> SAEOutput:
        if not (self.training and torch.is_grad_enabled()):
            return super()._output(x, vals, idx, aux_vals, aux_idx)
        hats = self.prefix_decodes(vals, idx)
        return SAEOutput(hats[-1], vals, idx, aux_vals, aux_idx, tuple(hats))

    def evaluation_parts(self, out: SAEOutput, y: torch.Tensor) -> dict:
        hats = out.x_hats or self.prefix_decodes(out.values, out.indices)
        return {f"prefix_{m}": (h, y) for m, h in zip(self.prefixes, hats, strict=True)}

    def metadata(self) -> dict[str, str]:
        return super().metadata() | {"matryoshka_prefixes": json.dumps(list(self.prefixes))}
