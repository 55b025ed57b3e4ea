"""The SAE modules' shared names (the architectures live in ``architectures/``), the
dense twin the tests compare the sparse TopK path with, and the geometric median used
to initialise ``decoder_bias``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .architectures import (
    BATCH_TOPK_ROW_CAP,
    PLACEMENT,
    TINY,
    BatchTopKSAE,
    JumpReLUSAE,
    SAEOutput,
    SparseAutoencoder,
    TopKSAE,
)
from .mesh import MODEL, mesh_dim_size

__all__ = [
    "BATCH_TOPK_ROW_CAP",
    "PLACEMENT",
    "TINY",
    "BatchTopKSAE",
    "JumpReLUSAE",
    "SAEOutput",
    "SparseAutoencoder",
    "TopKSAE",
    "dense_reference",
    "geometric_median",
]


def dense_reference(sae: TopKSAE, x: torch.Tensor, k: int | None = None) -> torch.Tensor:
    """The same TopK SAE computed the plain way (dense code, dense decoder matmul, autograd
    for everything); single process only. The sparse path must match it."""
    assert sae.mesh is None or mesh_dim_size(sae.mesh, MODEL) == 1
    pre = F.relu((x - sae.decoder_bias) @ sae.encoder_weight.t() + sae.encoder_bias)
    vals, idx = pre.topk(k or sae.k, dim=1)
    z = torch.zeros_like(pre).scatter(1, idx, vals)
    return z @ sae.decoder_weight + sae.decoder_bias


@torch.no_grad()
def geometric_median(points: torch.Tensor, iters: int = 50, eps: float = 1e-6) -> torch.Tensor:
    """Weiszfeld's algorithm: the point minimising the sum of Euclidean distances."""
    points = points.to(torch.float64)
    guess = points.mean(0)
    for _ in range(iters):
        weights = 1.0 / (points - guess).norm(dim=1).clamp_min(eps)
        new = (weights[:, None] * points).sum(0) / weights.sum()
        if (new - guess).norm() < eps * (1 + guess.norm()):
            guess = new
            break
        guess = new
    return guess.to(torch.float32)
