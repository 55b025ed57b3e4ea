"""The TopK sparse autoencoder, tensor-parallel over the latent dimension.

    z = TopK(ReLU(W_enc (x - b_dec) + b_enc)),    x_hat = z W_dec + b_dec

Parameters use the LUT spec's names: ``encoder_weight [n, d]``, ``encoder_bias [n]``,
``decoder_weight [n, d]``, ``decoder_bias [d]``. On a mesh with a "model" dimension the
first three are sharded on dim 0 (each rank owns ``n / model`` latents, see ``PLACEMENT``)
and ``decoder_bias`` is replicated. The top-k across shards costs one collective: every
rank takes its local top-k, the candidates' values are all-gathered, and every rank picks
the same global top-k from them and keeps its own winners.

The sparse path never forms the dense ``[B, n]`` code: decoding sums the k active decoder
rows (``embedding_bag``), and the encoder's backward touches only the k selected rows
(``_TopKEncode``). ``dense_reference`` is the straightforward twin the tests compare with.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..format.errors import InvalidArgumentError
from .mesh import (
    MODEL,
    DimMap,
    all_gather_cat,
    copy_to_model,
    mesh_dim_size,
    mesh_rank,
    reduce_from_model,
)

#: Floor of a variance or norm we divide by (an all-constant batch, a zero row).
TINY = 1e-12

#: BatchTopK keeps at most this many times k latents in one row (its per-row candidates).
BATCH_TOPK_ROW_CAP = 4

#: Where each parameter lives on a mesh: latents split along "model", replicated on "data".
PLACEMENT = {
    "encoder_weight": DimMap({MODEL: 0}),
    "encoder_bias": DimMap({MODEL: 0}),
    "decoder_weight": DimMap({MODEL: 0}),
    "decoder_bias": DimMap({}),
}


class _TopKEncode(torch.autograd.Function):
    """ReLU(xc @ W.T + b) followed by top-k, with a backward that scatters gradients into the
    k selected latents only (O(B k d) instead of the dense O(B n d)). Optionally also
    returns the top ``k_aux`` among ``dead`` latents for the AuxK loss, from the same
    pre-activations."""

    @staticmethod
    def forward(ctx, xc, weight, bias, k, dead, k_aux):
        pre = torch.addmm(bias, xc, weight.t()).relu_()
        vals, idx = pre.topk(k, dim=1, sorted=False)
        if dead is not None:
            aux_vals, aux_idx = pre.masked_fill_(~dead, 0).topk(k_aux, dim=1, sorted=False)
        else:
            aux_vals, aux_idx = vals[:, :0], idx[:, :0]
        ctx.save_for_backward(
            xc, weight, torch.cat([idx, aux_idx], 1), torch.cat([vals, aux_vals], 1)
        )
        ctx.mark_non_differentiable(idx, aux_idx)
        return vals, idx, aux_vals, aux_idx

    @staticmethod
    def backward(ctx, grad_vals, _gi, grad_aux, _ga):
        xc, weight, idx, vals = ctx.saved_tensors
        g = torch.cat([grad_vals, grad_aux], 1) * (vals > 0)  # ReLU: no gradient at zero
        grad_xc = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_xc = F.embedding_bag(
                idx, weight, per_sample_weights=g.to(weight.dtype), mode="sum"
            )
        flat_idx = idx.flatten()
        if ctx.needs_input_grad[1]:
            # grad_W[i] = sum over (b, j) with idx[b, j] == i of g[b, j] * xc[b]: an
            # embedding-bag over xc whose bags are the latents.
            order = flat_idx.argsort()
            counts = torch.bincount(flat_idx, minlength=weight.shape[0])
            offsets = torch.zeros(weight.shape[0] + 1, dtype=torch.long, device=idx.device)
            torch.cumsum(counts, 0, out=offsets[1:])
            rows = torch.div(order, idx.shape[1], rounding_mode="floor")
            grad_w = F.embedding_bag(
                rows,
                xc,
                offsets,
                mode="sum",
                per_sample_weights=g.flatten()[order].to(xc.dtype),
                include_last_offset=True,
            ).to(weight.dtype)
        if ctx.needs_input_grad[2]:
            grad_b = torch.zeros(weight.shape[0], dtype=g.dtype, device=g.device)
            grad_b.index_add_(0, flat_idx, g.flatten())
        return grad_xc, grad_w, grad_b, None, None, None


class SAEOutput(NamedTuple):
    x_hat: torch.Tensor  # [B, d]
    values: torch.Tensor  # [B, k_local] this rank's selected activations (0 where not selected)
    indices: torch.Tensor  # [B, k_local] global latent indices of ``values``
    aux_values: torch.Tensor  # [B, k_aux_local] for AuxK (empty when no latent is dead)
    aux_indices: torch.Tensor


class TopKSAE(nn.Module):
    """A TopK SAE whose latent dim may be sharded over ``mesh``'s "model" dimension.

    ``d``: input width; ``n_latents``: dictionary size (divisible by the model-parallel
    size); ``k``: active latents per input. Weights are initialised identically on every
    rank from ``seed`` (the decoder with unit-norm rows, the encoder as its transpose)
    and each rank keeps its shard, so any mesh starts from the same SAE.

    ``activation="batchtopk"`` (BatchTopK, Bussmann et al.): in training the batch's
    ``k * B`` largest pre-activations are kept, however they fall over its rows (at most
    ``BATCH_TOPK_ROW_CAP * k`` per row); in eval mode every pre-activation above
    ``threshold`` (the running mean of the smallest kept value, updated by the trainer)
    is kept, so a row's code no longer depends on its batch.
    """

    def __init__(
        self,
        d: int,
        n_latents: int,
        k: int,
        *,
        mesh=None,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        activation: str = "topk",
    ):
        super().__init__()
        if activation not in ("topk", "batchtopk"):
            raise InvalidArgumentError(
                f"activation must be 'topk' or 'batchtopk', got {activation!r}"
            )
        self.activation = activation
        self.register_buffer("threshold", torch.zeros((), device=device))
        self.last_threshold: torch.Tensor | None = None
        if not 0 < k <= n_latents:
            raise InvalidArgumentError(f"k must be in 1..n_latents ({n_latents}), got {k}")
        tp = mesh_dim_size(mesh, MODEL)
        if n_latents % tp:
            raise InvalidArgumentError(
                f"n_latents {n_latents} is not divisible by model_parallel_size {tp}"
            )
        self.d, self.n_latents, self.k, self.mesh = d, n_latents, k, mesh
        self.n_local = n_latents // tp
        self.offset = mesh_rank(mesh, MODEL) * self.n_local
        gen = torch.Generator().manual_seed(seed)
        dec = torch.randn(n_latents, d, generator=gen, dtype=torch.float32)
        dec /= dec.norm(dim=1, keepdim=True)
        full = {
            "encoder_weight": dec.clone(),
            "encoder_bias": torch.zeros(n_latents),
            "decoder_weight": dec,
            "decoder_bias": torch.zeros(d),
        }
        for name, tensor in full.items():
            local = PLACEMENT[name].distribute(tensor, mesh)
            self.register_parameter(name, nn.Parameter(local.to(device=device, dtype=dtype)))

    # --- forward -------------------------------------------------------------------------

    def _select(self, vals: torch.Tensor, k: int) -> torch.Tensor:
        """Zero this rank's candidates that lose the global top-k (one all-gather)."""
        if mesh_dim_size(self.mesh, MODEL) == 1:
            return vals
        cand = all_gather_cat(vals.detach(), self.mesh, MODEL, dim=1)  # [B, tp * k_local]
        win = torch.zeros_like(cand, dtype=torch.bool)
        win.scatter_(1, cand.topk(k, dim=1, sorted=False).indices, True)
        rank = mesh_rank(self.mesh, MODEL)
        mine = win[:, rank * vals.shape[1] : (rank + 1) * vals.shape[1]]
        return vals * mine

    def _select_batch(self, vals: torch.Tensor, k: int) -> torch.Tensor:
        """BatchTopK: keep the ``k * B`` largest candidates of the whole batch (training)
        or those above ``threshold`` (eval); records the smallest kept value."""
        if not self.training:
            return vals * (vals > self.threshold)
        cand = all_gather_cat(vals.detach(), self.mesh, MODEL, dim=1).flatten()
        cut = cand.topk(min(k * vals.shape[0], cand.numel()), sorted=False).values.min()
        kept = vals * (vals >= cut)
        self.last_threshold = cut.clamp_min(0)
        return kept

    def decode_latents(self, values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """``sum_j values[:, j] * decoder_weight[indices[:, j]]`` over every model rank,
        without ``decoder_bias``; ``indices`` are global."""
        part = F.embedding_bag(
            indices - self.offset,
            self.decoder_weight,
            per_sample_weights=values.to(self.decoder_weight.dtype),
            mode="sum",
        )
        return reduce_from_model(part, self.mesh)

    def encode(self, x: torch.Tensor, k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The code of ``x [B, d]``: ``(values, indices)`` of its top-k latents, each
        ``[B, k]`` on one process (this rank's winners, zeros elsewhere, on a mesh)."""
        out = self(x, k=k)
        return out.values, out.indices

    def decode(self, values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """The reconstruction ``sum_j values_j W_dec[indices_j] + b_dec`` of a code."""
        return self.decode_latents(values, indices) + self.decoder_bias

    def forward(
        self,
        x: torch.Tensor,
        *,
        k: int | None = None,
        dead: torch.Tensor | None = None,
        k_aux: int = 0,
    ) -> SAEOutput:
        """Encode and decode ``x [B, d]``. ``dead`` (bool ``[n_local]``) with ``k_aux``
        also selects the AuxK latents among the dead ones."""
        k = k or self.k
        xc = copy_to_model(x.to(self.encoder_weight.dtype) - self.decoder_bias, self.mesh)
        batch = self.activation == "batchtopk"
        k_local = min(BATCH_TOPK_ROW_CAP * k if batch else k, self.n_local)
        use_aux = dead is not None and k_aux > 0
        k_aux = min(k_aux, self.n_local) if use_aux else 0
        vals, idx, aux_vals, aux_idx = _TopKEncode.apply(
            xc, self.encoder_weight, self.encoder_bias, k_local, dead if use_aux else None, k_aux
        )
        vals = self._select_batch(vals, k) if batch else self._select(vals, k)
        idx = idx + self.offset
        if use_aux:
            aux_vals, aux_idx = self._select(aux_vals, k_aux), aux_idx + self.offset
        x_hat = self.decode(vals, idx)
        return SAEOutput(x_hat, vals, idx, aux_vals, aux_idx)

    # --- constraints and state -----------------------------------------------------------

    @torch.no_grad()
    def normalize_decoder(self) -> None:
        self.decoder_weight /= self.decoder_weight.norm(dim=1, keepdim=True).clamp_min(TINY)

    @torch.no_grad()
    def remove_parallel_gradient(self) -> None:
        """Drop the decoder gradient's component along each (unit) row, so the step moves
        rows along the sphere instead of fighting the renormalisation."""
        w, g = self.decoder_weight, self.decoder_weight.grad
        if g is not None:
            g -= (g * w).sum(dim=1, keepdim=True) * w

    def full_shapes(self) -> dict[str, tuple[int, ...]]:
        n, d = self.n_latents, self.d
        return {
            "encoder_weight": (n, d),
            "encoder_bias": (n,),
            "decoder_weight": (n, d),
            "decoder_bias": (d,),
        }

    def full_state(self) -> dict[str, torch.Tensor]:
        """Every parameter gathered to its full shape (a collective on every rank)."""
        return {
            name: PLACEMENT[name].gather(p.detach(), self.mesh).contiguous()
            for name, p in self.named_parameters()
        }

    @torch.no_grad()
    def load_full_state(self, state: dict[str, torch.Tensor]) -> None:
        """Load full-shape tensors (every rank passes the same), keeping this rank's shard."""
        for name, p in self.named_parameters():
            want = self.full_shapes()[name]
            got = tuple(state[name].shape)
            if got != want:
                raise InvalidArgumentError(f"{name}: checkpoint shape {got}, this SAE needs {want}")
            p.copy_(PLACEMENT[name].distribute(state[name].to(torch.float32), self.mesh))


def dense_reference(sae: TopKSAE, x: torch.Tensor, k: int | None = None) -> torch.Tensor:
    """The same SAE computed the plain way (dense code, dense decoder matmul, autograd for
    everything); single process only. The sparse path must match it."""
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
