"""TopK (Gao et al. 2024): the k largest ReLU pre-activations of each row.

    z = TopK(ReLU(W_enc (x - b_dec) + b_enc)),    x_hat = z W_dec + b_dec

The top-k across "model" shards costs one collective: every rank takes its local top-k,
the candidates' values are all-gathered, and every rank picks the same global top-k from
them and keeps its own winners. The sparse path never forms the dense ``[B, n]`` code:
decoding sums the k active decoder rows (``embedding_bag``), and the encoder's backward
touches only the k selected rows (``_TopKEncode``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..mesh import copy_to_model
from .base import SAEOutput, SparseAutoencoder


class _TopKEncode(torch.autograd.Function):
    """ReLU(xc @ W.T + b) followed by top-k, with a backward that scatters gradients into the
    k selected latents only (O(B k d) instead of the dense O(B n d)). Optionally also
    returns the top ``k_aux`` among ``dead`` latents of the first ``aux_rows`` rows for the
    AuxK loss, from the same pre-activations."""

    @staticmethod
    def forward(ctx, xc, weight, bias, k, dead, k_aux, aux_rows):
        pre = torch.addmm(bias, xc, weight.t()).relu_()
        vals, idx = pre.topk(k, dim=1, sorted=False)
        if dead is not None:
            aux = pre[:aux_rows].masked_fill_(~dead, 0)
            aux_vals, aux_idx = aux.topk(k_aux, dim=1, sorted=False)
        else:
            aux_vals, aux_idx = vals[:0, :0], idx[:0, :0]
        ctx.save_for_backward(xc, weight, idx, vals, aux_idx, aux_vals)
        ctx.mark_non_differentiable(idx, aux_idx)
        return vals, idx, aux_vals, aux_idx

    @staticmethod
    def backward(ctx, grad_vals, _gi, grad_aux, _ga):
        xc, weight, idx, vals, aux_idx, aux_vals = ctx.saved_tensors
        g = grad_vals * (vals > 0)  # ReLU: no gradient at zero
        g_aux = grad_aux * (aux_vals > 0)
        grad_xc = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_xc = F.embedding_bag(idx, weight, per_sample_weights=g.to(weight.dtype),
                                      mode="sum")  # fmt: skip
            if aux_idx.numel():
                grad_xc[: len(aux_idx)] += F.embedding_bag(
                    aux_idx, weight, per_sample_weights=g_aux.to(weight.dtype), mode="sum"
                )
        # every (row, latent, gradient) triple of the code and of the AuxK code
        flat_idx = torch.cat([idx.flatten(), aux_idx.flatten()])
        flat_g = torch.cat([g.flatten(), g_aux.flatten()])
        if ctx.needs_input_grad[1]:
            # grad_W[i] = sum over the triples (b, i, g) of g * xc[b]: an embedding-bag over
            # xc whose bags are the latents.
            rows = torch.cat([
                torch.arange(idx.shape[0], device=idx.device).repeat_interleave(idx.shape[1]),
                torch.arange(aux_idx.shape[0], device=idx.device).repeat_interleave(
                    aux_idx.shape[1]),
            ])  # fmt: skip
            order = flat_idx.argsort()
            counts = torch.bincount(flat_idx, minlength=weight.shape[0])
            offsets = torch.zeros(weight.shape[0] + 1, dtype=torch.long, device=idx.device)
            torch.cumsum(counts, 0, out=offsets[1:])
            grad_w = F.embedding_bag(
                rows[order],
                xc,
                offsets,
                mode="sum",
                per_sample_weights=flat_g[order].to(xc.dtype),
                include_last_offset=True,
            ).to(weight.dtype)
        if ctx.needs_input_grad[2]:
            grad_b = torch.zeros(weight.shape[0], dtype=g.dtype, device=g.device)
            grad_b.index_add_(0, flat_idx, flat_g)
        return grad_xc, grad_w, grad_b, None, None, None, None


class TopKSAE(SparseAutoencoder):
    """k latents per row, the same in training and in use; the LUT's per-row top-k
    reproduces it exactly."""

    ARCHITECTURE = "topk"

    def _candidates(self, k: int) -> int:
        """Candidates each rank keeps per row before the global selection."""
        return min(k, self.n_local)

    def _select_code(self, vals: torch.Tensor, k: int) -> torch.Tensor:
        return self._global_top(vals, k)

    def forward(
        self,
        x: torch.Tensor,
        *,
        k: int | None = None,
        dead: torch.Tensor | None = None,
        k_aux: int = 0,
        aux_rows: int | None = None,
    ) -> SAEOutput:
        """Encode and decode ``x [B, d]``. ``dead`` (bool ``[n_local]``) with ``k_aux``
        also selects the AuxK latents among the dead ones, for the first ``aux_rows`` rows
        (None: every row; ``aux_values`` and ``aux_indices`` have that many rows)."""
        k = k or self.k
        xc = copy_to_model(self.encoder_input(x), self.mesh)
        use_aux = dead is not None and k_aux > 0
        k_aux = min(k_aux, self.n_local) if use_aux else 0
        vals, idx, aux_vals, aux_idx = _TopKEncode.apply(
            xc, self.encoder_weight, self.encoder_bias, self._candidates(k),
            dead if use_aux else None, k_aux, len(x) if aux_rows is None else aux_rows,
        )  # fmt: skip
        vals = self._select_code(vals, k)
        idx = idx + self.offset
        if use_aux:
            aux_vals, aux_idx = self._global_top(aux_vals, k_aux), aux_idx + self.offset
        return self._output(x, vals, idx, aux_vals, aux_idx)

    def encoder_input(self, x: torch.Tensor) -> torch.Tensor:
        """What the encoder multiplies: ``x - b_dec`` (an SAE centres its input on the
        decoder bias; a transcoder's ``b_dec`` lives in the output space)."""
        return x.to(self.encoder_weight.dtype) - self.decoder_bias

    def _output(self, x, vals, idx, aux_vals, aux_idx) -> SAEOutput:
        """The forward's result from the code: the reconstruction and the code."""
        return SAEOutput(self.decode(vals, idx), vals, idx, aux_vals, aux_idx)
