"""BatchTopK (Bussmann et al. 2024): in training the batch's ``k * B`` largest
pre-activations are kept, however they fall over its rows (at most
``BATCH_TOPK_ROW_CAP * k`` per row); in eval mode every pre-activation above ``threshold``
(the running mean of the smallest kept value, updated after each training step) is kept,
so a row's code no longer depends on its batch. The LUT's per-row top-k approximates it
(``docs/sae.md``)."""

from __future__ import annotations

import torch

from ..mesh import DATA, MODEL, all_gather_cat, all_reduce
from .topk import TopKSAE

#: BatchTopK keeps at most this many times k latents in one row (its per-row candidates).
BATCH_TOPK_ROW_CAP = 4


class BatchTopKSAE(TopKSAE):
    """k x batch latents per training batch, a learned scalar threshold in use."""

    ARCHITECTURE = "batchtopk"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        device = self.encoder_weight.device
        self.register_buffer("threshold", torch.zeros((), device=device))
        self.last_threshold: torch.Tensor | None = None

    def _candidates(self, k: int) -> int:
        return min(BATCH_TOPK_ROW_CAP * k, self.n_local)

    def _select_code(self, vals: torch.Tensor, k: int) -> torch.Tensor:
        """Keep the ``k * B`` largest candidates of the whole batch (training) or those
        above ``threshold`` (eval); records the smallest kept value."""
        if not self.training:
            return vals * (vals > self.threshold)
        cand = all_gather_cat(vals.detach(), self.mesh, MODEL, dim=1).flatten()
        cut = cand.topk(min(k * vals.shape[0], cand.numel()), sorted=False).values.min()
        self.last_threshold = cut.clamp_min(0)
        return vals * (vals >= cut)

    @torch.no_grad()
    def after_forward(self) -> None:
        """The inference threshold: a 10-step EMA of the smallest value each training
        batch kept, averaged over the data ranks."""
        if self.last_threshold is None:
            return
        cut = all_reduce(self.last_threshold.detach().float().reshape(1), self.mesh, DATA,
                         op="mean")  # fmt: skip
        first = not float(self.threshold)
        self.threshold.copy_(cut[0] if first else 0.9 * self.threshold + 0.1 * cut[0])
        self.last_threshold = None

    def metadata(self) -> dict[str, str]:
        return super().metadata() | {"threshold": repr(float(self.threshold))}
