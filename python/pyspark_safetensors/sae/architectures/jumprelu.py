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

A forward forms the dense pre-activations without the graph, lists the entries above
their thresholds (in training: above ``θ - ε/2``, the kernel's reach, whose code is 0
below θ) and back-propagates through those alone (``EntryEncode``, ``ThresholdCode``,
``Fires``: O(entries d) instead of the dense O(B n d)); the decoder sums each row's
entries (``embedding_bag``). Every gradient equals the dense formulation's (a test); a
step costs about a TopK step (15.6 against 11.8 ms for 1,024 rows, 1,024 latents, width
256 at L0 14, one thread; the dense code's took 45.9). The cross-layer transcoder's
trained thresholds use the same three functions.

The threshold is per latent, so it shards with the encoder rows; no collective is needed
to pick the code. A row's number of active latents varies, so ``values``/``indices`` hold
as many slots as the busiest row of the batch has on this rank (zeros elsewhere). The
LUT's per-row top-k cannot reproduce such a code, so the LUT job refuses it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

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


class ThresholdCode(torch.autograd.Function):
    """``v * 1[v > theta]`` elementwise (``theta``, ``eps``: each entry's latent's
    threshold and kernel width): the gradient passes to ``v`` where it fired, and to
    ``theta`` through the rectangle kernel, ``-(theta / eps) K((v - theta) / eps)``."""

    @staticmethod
    def forward(ctx, vals, theta, eps):
        ctx.save_for_backward(vals, theta, eps)
        return vals * (vals > theta)

    @staticmethod
    def backward(ctx, grad):
        vals, theta, eps = ctx.saved_tensors
        grad_theta = -(theta / eps) * _rectangle((vals - theta) / eps) * grad
        return grad * (vals > theta), grad_theta, None


class Fires(torch.autograd.Function):
    """``1[v > theta]``, elementwise; only ``theta`` gets a pseudo-derivative,
    ``-(1 / eps) K((v - theta) / eps)``."""

    @staticmethod
    def forward(ctx, vals, theta, eps):
        ctx.save_for_backward(vals, theta, eps)
        return (vals > theta).to(vals.dtype)

    @staticmethod
    def backward(ctx, grad):
        vals, theta, eps = ctx.saved_tensors
        return None, -(1 / eps) * _rectangle((vals - theta) / eps) * grad, None


class EntryEncode(torch.autograd.Function):
    """The pre-activations ``x W^T + b`` at the entries ``(rows, latents)``, listed row by
    row (``values``, computed outside the graph), with a backward that touches only those
    entries' latents and rows (``topk.py``'s sparse backward: O(entries d), not the dense
    O(B n d))."""

    @staticmethod
    def forward(ctx, x, weight, bias, rows, latents, values):
        ctx.save_for_backward(x, weight, rows, latents)
        return values.clone()  # computed without the graph: the entries' pre-activations

    @staticmethod
    def backward(ctx, grad):
        x, weight, rows, latents = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        n = weight.shape[0]
        if ctx.needs_input_grad[0]:  # grad_x[r] = sum over r's entries (i, g) of g W[i]
            grad_x = F.embedding_bag(latents, weight, _offsets(rows, len(x)), mode="sum",
                                     per_sample_weights=grad.to(weight.dtype),
                                     include_last_offset=True).to(x.dtype)  # fmt: skip
        if ctx.needs_input_grad[1]:  # grad_W[i] = sum over i's entries (r, g) of g x[r]
            order = latents.argsort(stable=True)
            grad_w = F.embedding_bag(rows[order], x, _offsets(latents[order], n), mode="sum",
                                     per_sample_weights=grad[order].to(x.dtype),
                                     include_last_offset=True).to(weight.dtype)  # fmt: skip
        if ctx.needs_input_grad[2]:
            grad_b = torch.zeros(n, dtype=grad.dtype, device=grad.device)
            grad_b.index_add_(0, latents, grad)
        return grad_x, grad_w, grad_b, None, None, None


def _offsets(sorted_keys: torch.Tensor, n: int) -> torch.Tensor:
    """``[n + 1]`` bag offsets of ``n`` bags over entries sorted by their bag."""
    offsets = torch.zeros(n + 1, dtype=torch.long, device=sorted_keys.device)
    torch.cumsum(torch.bincount(sorted_keys, minlength=n), 0, out=offsets[1:])
    return offsets


class JumpReLUSAE(SparseAutoencoder):
    """A JumpReLU SAE; ``k`` is the target L0 of training. ``bandwidth``, ``l0_coef`` and
    ``init_threshold`` set the estimator (module docstring)."""

    ARCHITECTURE = "jumprelu"
    EXTRA_TENSORS = ("threshold",)
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
        #: The training forward's entries (values, thresholds, kernel widths) for the penalty.
        self._tuned: tuple[torch.Tensor, ...] | None = None
        self.last_penalty = 0.0

    @classmethod
    def config_options(cls, config) -> dict:
        return {"bandwidth": config.jumprelu_bandwidth, "l0_coef": config.l0_coef,
                "init_threshold": config.jumprelu_init_threshold}  # fmt: skip

    @property
    def threshold(self) -> torch.Tensor:
        """This rank's thresholds ``[n_local]``, in the encoder's dtype."""
        return self.log_threshold.exp().to(self.encoder_weight.dtype)

    def _code_entries(self, x: torch.Tensor, tuning: bool):
        """Encode ``x [B, d]``: ``(rows, latents, code)`` of the entries whose
        pre-activation is above the latent's threshold (``tuning``: above it less half the
        kernel's width, where the threshold's gradient reaches; their code is 0 below the
        threshold), listed row by row, the code straight through (``ThresholdCode``). The
        dense pre-activations are formed without the graph, so the backward touches only
        the entries (``EntryEncode``). Also returns the centred input and the dense
        pre-activations (outside the graph), for ``_aux_code``."""
        xc = copy_to_model(x.to(self.encoder_weight.dtype) - self.decoder_bias, self.mesh)
        theta = self.threshold
        with torch.no_grad():
            pre = torch.addmm(self.encoder_bias, xc, self.encoder_weight.t())
            reach = theta - self.bandwidth / 2 if tuning else theta
            flat = (pre > reach).flatten().nonzero().squeeze(1)  # row-major
            rows, latents = flat // pre.shape[1], flat % pre.shape[1]
        v = EntryEncode.apply(xc, self.encoder_weight, self.encoder_bias, rows, latents,
                              pre.flatten()[flat])  # fmt: skip
        th = theta[latents]
        if not tuning:
            return rows, latents, v * (v > th), xc, pre
        eps = v.new_full((), self.bandwidth).expand_as(v)
        self._tuned = (v.detach(), th, eps)
        return rows, latents, ThresholdCode.apply(v, th, eps), xc, pre

    def _aux_code(self, xc: torch.Tensor, pre: torch.Tensor, dead: torch.Tensor, k_aux: int,
                  aux_rows: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """AuxK's code (as ``topk.py``'s): on the first ``aux_rows`` rows, the ``k_aux``
        largest pre-activations of the dead latents, whatever their thresholds (0 where
        negative), the global top over the model ranks; the gradient reaches those
        entries' encoder rows alone (``EntryEncode``), so a dead latent learns to explain
        what the live ones miss until it crosses its threshold again."""
        aux_rows = min(aux_rows, len(pre))  # the trainer's aux_rows may exceed a small batch
        with torch.no_grad():
            cand = pre[:aux_rows].masked_fill(~dead, 0)
            idx = cand.topk(k_aux, dim=1, sorted=False).indices
            rows = torch.arange(aux_rows, device=pre.device).repeat_interleave(k_aux)
            latents = idx.flatten()
        v = EntryEncode.apply(xc, self.encoder_weight, self.encoder_bias, rows, latents,
                              pre[rows, latents])  # fmt: skip
        v = (v * (v > 0)).view(aux_rows, k_aux)
        return self._global_top(v, k_aux), idx + self.offset

    def forward(self, x: torch.Tensor, *, k=None, dead=None, k_aux=0, aux_rows=None) -> SAEOutput:
        """Encode and decode ``x [B, d]`` (``k`` is accepted for the trainer's sake and
        unused: the thresholds decide); the decoder sums each row's fired latents
        (``embedding_bag``), never a dense ``[B, n]`` code. ``dead`` (bool ``[n_local]``)
        with ``k_aux`` also gives AuxK's code of the first ``aux_rows`` rows
        (``_aux_code``)."""
        self._tuned = None
        tuning = self.training and torch.is_grad_enabled()
        rows, latents, code, xc, pre = self._code_entries(x, tuning)
        offsets = torch.searchsorted(rows, torch.arange(len(x), device=rows.device))
        part = F.embedding_bag(latents, self.decoder_weight, offsets, mode="sum",
                               per_sample_weights=code.to(self.decoder_weight.dtype))  # fmt: skip
        x_hat = reduce_from_model(part, self.mesh) + self.decoder_bias
        values, indices = self._slots(rows, latents, code.detach(), len(x))
        if dead is not None and k_aux > 0:
            aux_values, aux_indices = self._aux_code(
                xc, pre, dead, min(k_aux, self.n_local), len(x) if aux_rows is None else aux_rows
            )
        else:
            aux_values, aux_indices = self._empty_aux(values, indices)
        return SAEOutput(x_hat, values, indices, aux_values, aux_indices)

    def encode(self, x: torch.Tensor, k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The code of ``x [B, d]`` as ``forward`` gives it, without decoding (``k`` unused):
        ``(values, indices)``, each row padded with zeros to the batch's largest count
        (global indices)."""
        rows, latents, code, _, _ = self._code_entries(x, tuning=False)
        return self._slots(rows, latents, code.detach(), len(x))

    @torch.no_grad()
    def _slots(self, rows, latents, code, n_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(values, indices)`` of the fired entries, each row's in as many slots as the
        busiest row has, the rest zeros at latents that did not fire (global indices): a
        scatter of them gives the dense code."""
        z = code.new_zeros(n_rows, self.n_local)
        z[rows, latents] = code
        slots = max(1, int((z > 0).sum(1).max()))
        values, indices = z.topk(slots, dim=1, sorted=False)
        return values, indices + self.offset

    def sparsity_loss(self, out: SAEOutput) -> torch.Tensor | None:
        """A term whose gradient is that of ``l0_coef * (L0 / k - 1)^2`` over the global
        batch once the data ranks' gradients are averaged: the global L0 is all-reduced
        (a constant), this rank's firing counts carry the gradient to its thresholds
        (``Fires`` over the training forward's entries, which hold every one within the
        kernel's reach). The penalty's value is kept in ``last_penalty``."""
        if self._tuned is None or not self.l0_coef:
            return None
        counts = Fires.apply(*self._tuned).sum()
        self._tuned = None
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
