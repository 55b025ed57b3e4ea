"""JumpReLU (Rajamanoharan et al. 2024, "Jumping Ahead"; the architecture of Gemma Scope
and of SAELens' ``jumprelu`` SAEs): a learned threshold per latent.

    pre = W_enc (x - b_dec) + b_enc,    a = pre * 1[pre > threshold],    x_hat = a W_dec + b_dec

The step has no useful gradient, so training uses straight-through estimators with a
rectangle kernel of width ``bandwidth`` ε: the threshold θ gets ``-(θ/ε) K((pre-θ)/ε)``
from the reconstruction and ``-(1/ε) K((pre-θ)/ε)`` from the L0 penalty, ``K(u) = 1[|u| <
1/2]``. The penalty pulls the global batch's mean L0 to the target ``k``:
``l0_coef * (L0 / k - 1)^2`` (the paper's ``λ L0`` with a coefficient that changes sign at
the target instead of a λ to sweep). The threshold is trained as ``log_threshold`` (it
stays positive) and stored in checkpoints as ``threshold``, as SAELens does.

The threshold is per latent, so it shards with the encoder rows; no collective is needed
to pick the code. A row's number of active latents varies, so ``values``/``indices`` hold
as many slots as the busiest row of the batch has on this rank (zeros elsewhere). The
LUT's per-row top-k cannot reproduce such a code, so the LUT job refuses it.
"""

from __future__ import annotations

import math

import torch

from ...format.errors import InvalidArgumentError
from ..mesh import DATA, MODEL, all_reduce, copy_to_model, mesh_dim_size, reduce_from_model
from .base import SAEOutput, SparseAutoencoder

#: Defaults of the estimator: the kernel's width and the thresholds' starting value, in
#: units of the pre-activations (SAELens' and the paper's 0.001 assume inputs normalised
#: to unit mean square; ours are the raw activations, whose per-coordinate scale is
#: usually 0.1 to 10).
BANDWIDTH = 0.05
INIT_THRESHOLD = 0.05


def _rectangle(u: torch.Tensor) -> torch.Tensor:
    return ((u > -0.5) & (u < 0.5)).to(u.dtype)


class _JumpReLU(torch.autograd.Function):
    """``pre * 1[pre > θ]``: the gradient passes to ``pre`` where it fired, and to θ
    through the rectangle-kernel pseudo-derivative."""

    @staticmethod
    def forward(ctx, pre, theta, bandwidth):
        ctx.save_for_backward(pre, theta)
        ctx.bandwidth = bandwidth
        return pre * (pre > theta)

    @staticmethod
    def backward(ctx, grad):
        pre, theta = ctx.saved_tensors
        eps = ctx.bandwidth
        grad_pre = grad * (pre > theta)
        kernel = _rectangle((pre - theta) / eps)
        grad_theta = (-(theta / eps) * kernel * grad).sum(0)
        return grad_pre, grad_theta.to(theta.dtype), None


class _Step(torch.autograd.Function):
    """``1[pre > θ]``, the L0 of each (row, latent); only θ gets a pseudo-derivative."""

    @staticmethod
    def forward(ctx, pre, theta, bandwidth):
        ctx.save_for_backward(pre, theta)
        ctx.bandwidth = bandwidth
        return (pre > theta).to(pre.dtype)

    @staticmethod
    def backward(ctx, grad):
        pre, theta = ctx.saved_tensors
        eps = ctx.bandwidth
        grad_theta = (-(1.0 / eps) * _rectangle((pre - theta) / eps) * grad).sum(0)
        return None, grad_theta.to(theta.dtype), None


class JumpReLUSAE(SparseAutoencoder):
    """A JumpReLU SAE; ``k`` is the target L0 of training. ``bandwidth``, ``l0_coef`` and
    ``init_threshold`` set the estimator (module docstring)."""

    ARCHITECTURE = "jumprelu"
    EXTRA_TENSORS = ("threshold",)
    USES_AUX = False
    SELECTS_TOP_K = False  # thresholds pick the code; k is only training's L0 target
    LUT_REFUSAL = (
        "a JumpReLU SAE fires every latent above its own threshold, so a row's number of "
        "active latents varies; the LUT's per-row top-k cannot reproduce that code "
        "(docs/lut.md says what a LUT would need)"
    )

    def __init__(
        self,
        d: int,
        n_latents: int,
        k: int,
        *,
        bandwidth: float = BANDWIDTH,
        l0_coef: float = 1.0,
        init_threshold: float = INIT_THRESHOLD,
        **kwargs,
    ):
        super().__init__(d, n_latents, k, **kwargs)
        if bandwidth <= 0 or init_threshold <= 0 or l0_coef < 0:
            raise InvalidArgumentError(
                "jumprelu_bandwidth and jumprelu_init_threshold must be > 0, l0_coef >= 0"
            )
        self.bandwidth, self.l0_coef = bandwidth, l0_coef
        # float64, so that a threshold read from a file comes back bit for bit through exp(log)
        start = torch.full((self.n_local,), math.log(init_threshold), dtype=torch.float64)
        self.log_threshold = torch.nn.Parameter(start.to(self.encoder_weight.device))
        self._pre: torch.Tensor | None = None
        self.last_penalty = 0.0

    @classmethod
    def config_options(cls, config) -> dict:
        return {"bandwidth": config.jumprelu_bandwidth, "l0_coef": config.l0_coef,
                "init_threshold": config.jumprelu_init_threshold}  # fmt: skip

    @property
    def threshold(self) -> torch.Tensor:
        """This rank's thresholds ``[n_local]``, in the encoder's dtype."""
        return self.log_threshold.exp().to(self.encoder_weight.dtype)

    def _pre_activation(self, x: torch.Tensor) -> torch.Tensor:
        xc = copy_to_model(x.to(self.encoder_weight.dtype) - self.decoder_bias, self.mesh)
        return torch.addmm(self.encoder_bias, xc, self.encoder_weight.t())

    def _code(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(values, indices)`` of the fired latents of ``z``, each row padded with zeros
        to the batch's largest count (global indices)."""
        with torch.no_grad():
            slots = max(1, int((z > 0).sum(1).max()))
            values, indices = z.detach().topk(slots, dim=1, sorted=False)
        return values, indices + self.offset

    def forward(self, x: torch.Tensor, *, k=None, dead=None, k_aux=0, aux_rows=None) -> SAEOutput:
        """Encode and decode ``x [B, d]`` (``k`` and the AuxK arguments are accepted for the
        trainer's sake and unused: the thresholds decide)."""
        pre = self._pre_activation(x)
        z = _JumpReLU.apply(pre, self.threshold, self.bandwidth)
        x_hat = reduce_from_model(z @ self.decoder_weight.to(z.dtype), self.mesh)
        x_hat = x_hat + self.decoder_bias
        self._pre = pre if self.training and torch.is_grad_enabled() else None
        values, indices = self._code(z)
        aux_values, aux_indices = self._empty_aux(values, indices)
        return SAEOutput(x_hat, values, indices, aux_values, aux_indices)

    def encode(self, x: torch.Tensor, k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The code of ``x [B, d]`` as ``forward`` gives it, without decoding (``k`` unused)."""
        return self._code(_JumpReLU.apply(self._pre_activation(x), self.threshold, self.bandwidth))

    def sparsity_loss(self, out: SAEOutput) -> torch.Tensor | None:
        """A term whose gradient is that of ``l0_coef * (L0 / k - 1)^2`` over the global
        batch once the data ranks' gradients are averaged: the global L0 is all-reduced
        (a constant), this rank's step counts carry the gradient to its thresholds. The
        penalty's value is kept in ``last_penalty``."""
        if self._pre is None or not self.l0_coef:
            return None
        counts = _Step.apply(self._pre, self.threshold, self.bandwidth).sum()
        self._pre = None
        stats = torch.stack(
            [counts.detach().double(), counts.new_tensor(out.values.shape[0]).double()]
        )
        all_reduce(stats, self.mesh, DATA)
        total = all_reduce(stats[:1].clone(), self.mesh, MODEL)[0]
        l0, rows = float(total / stats[1]), float(stats[1])
        self.last_penalty = self.l0_coef * (l0 / self.k - 1) ** 2
        slope = 2 * self.l0_coef * (l0 / self.k - 1) / self.k  # d penalty / d L0
        return counts * (slope * mesh_dim_size(self.mesh, DATA) / rows)

    def local_state(self) -> dict[str, torch.Tensor]:
        return super().local_state() | {"threshold": self.threshold.detach()}

    def load_local_state(self, local: dict[str, torch.Tensor]) -> None:
        super().load_local_state(local)
        # A threshold <= 0 fires as 0 does (a ReLU): log 0 = -inf comes back as exactly 0.
        self.log_threshold.copy_(local["threshold"].double().clamp_min(0.0).log())

    def metadata(self) -> dict[str, str]:
        return super().metadata() | {"bandwidth": repr(self.bandwidth)}
