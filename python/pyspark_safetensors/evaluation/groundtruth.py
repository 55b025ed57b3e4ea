"""How well an SAE recovers known features: SAELens' synthetic-data metrics
(``sae_lens.synthetic.evals.eval_sae_on_synthetic_data``, sae-lens 6.54), computed the
same way, plus feature absorption on the model's hierarchy.

Of an SAE with decoder rows ``D [n, H]`` and encoder ``z(x)``, on samples ``x = a W + b``
whose true activations ``a [F]`` are known (``W [F, H]``: the true directions):

- ``mcc``: the mean ``|cos(D_i, W_j)|`` over a one-to-one matching of latents to features
  that maximises it (Hungarian, scipy's ``linear_sum_assignment`` on ``1 - |cos|``;
  ``min(n, F)`` pairs);
- ``uniqueness``: the number of distinct features among each latent's best match
  (``argmax_j |cos(D_i, W_j)|``), over ``n``;
- ``precision``, ``recall``, ``f1``, ``accuracy``: each latent as a detector of its best
  match (a latent fires where ``z_i != 0``, a feature where ``a_j > 0``), per latent (0
  where undefined), then the mean over the latents;
- ``explained_variance``: ``1 - E|x - x_hat|^2 / (E|x|^2 - |E x|^2)`` (float64 sums);
- ``sae_l0`` and ``true_l0``: mean active latents and features per sample; ``dead_latents``:
  latents that never fire on the samples; ``shrinkage``: mean ``|x_hat| / |x|`` over the
  samples with ``|x| > 1e-6``;
- ``absorption`` (not in SAELens: the issue's definition, on the hierarchy): for a parent
  feature ``P`` with a matched latent ``l(P)`` (the MCC matching), the share of the samples
  where ``P`` fires in which ``l(P)`` is silent while some child ``c`` of ``P`` that fires
  there has its matched latent ``l(c)`` firing (the child's latent took the parent's
  place); the mean over the parents that fire at least once and have a matched latent
  (``absorption_parents`` of them; NaN when there are none), and per parent in
  ``per_parent_absorption``.

Samples arrive in batches of ``(x [B, H], feature_indices [B, W], feature_values [B, W])``
(the sparse truth: indices padded with -1), as the synthetic datasets store them
(``job.py``, ``ground_truth_batches``); memory is bounded by ``B x max(n, F)``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from ..format.errors import InvalidArgumentError
from .core import dense_code

#: Samples whose input norm is below this are left out of the shrinkage (SAELens').
MIN_INPUT_NORM = 1e-6


@dataclass(frozen=True)
class GroundTruthMetrics:
    """An SAE's figures against the true features (module docstring)."""

    mcc: float
    uniqueness: float
    precision: float
    recall: float
    f1: float
    accuracy: float
    explained_variance: float
    sae_l0: float
    true_l0: float
    dead_latents: int
    shrinkage: float
    absorption: float
    absorption_parents: int
    samples: int
    per_parent_absorption: dict[int, float] = field(default_factory=dict, repr=False)

    def to_dict(self) -> dict:
        """Every figure, JSON-ready (NaN as None)."""
        out = asdict(self)
        out["per_parent_absorption"] = {str(k): v for k, v in self.per_parent_absorption.items()}
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in out.items()}


def cosine_similarities(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``[n_a, n_b]`` cosines of the rows (norms floored at 1e-8, as SAELens')."""
    a = a / a.norm(dim=1, keepdim=True).clamp(min=1e-8)
    b = b / b.norm(dim=1, keepdim=True).clamp(min=1e-8)
    return a @ b.T


def match_latents(
    decoder: torch.Tensor, features: torch.Tensor
) -> tuple[np.ndarray, np.ndarray, float]:
    """``(latent_of_feature [F], best_feature [n], mcc)``: the Hungarian matching (-1 for a
    feature left unmatched), each latent's best feature, and the MCC."""
    from scipy.optimize import linear_sum_assignment

    cos = cosine_similarities(decoder.float(), features.float()).abs()
    rows, cols = linear_sum_assignment(1 - cos.cpu().numpy())
    latent_of = np.full(features.shape[0], -1, dtype=np.int64)
    latent_of[cols] = rows
    mcc = float(cos[torch.from_numpy(rows), torch.from_numpy(cols)].mean())
    return latent_of, cos.argmax(dim=1).cpu().numpy(), mcc


def dense_truth(indices: torch.Tensor, values: torch.Tensor, num_features: int) -> torch.Tensor:
    """``[B, F]`` activations from the padded sparse truth (index -1: padding)."""
    out = torch.zeros(indices.shape[0], num_features, dtype=torch.float32)
    keep = indices >= 0
    rows = torch.arange(indices.shape[0]).unsqueeze(1).expand_as(indices)
    out[rows[keep], indices[keep].long()] = values[keep].float()
    return out


class _Sums:
    """Running sums of every streamed figure."""

    def __init__(self, n: int, f: int, h: int):
        self.n_samples = 0
        self.true_active = 0.0
        self.latent_active = 0.0
        self.fired = torch.zeros(n, dtype=torch.bool)
        self.shrink, self.shrink_rows = 0.0, 0
        self.sum_x = torch.zeros(h, dtype=torch.float64)
        self.sum_sq, self.sum_res = 0.0, 0.0
        self.tp, self.fp, self.fn, self.tn = (torch.zeros(n, dtype=torch.float64) for _ in range(4))
        self.parent_fires = torch.zeros(f, dtype=torch.float64)
        self.absorbed = torch.zeros(f, dtype=torch.float64)


@torch.no_grad()
def evaluate_ground_truth(
    sae,
    feature_vectors: torch.Tensor,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    *,
    parent_of: np.ndarray | None = None,
    core=None,
) -> GroundTruthMetrics:
    """The figures of ``sae`` (any architecture of ``sae/architectures`` but the cross-layer
    transcoder, in eval mode: a BatchTopK SAE encodes by its threshold) against the true
    ``feature_vectors [F, H]`` on ``batches`` (module docstring); ``parent_of [F]``
    (``SyntheticModel.parent_of``; None: no hierarchy) gives the absorption. ``core``: a
    ``core.CoreSums`` fed the same passes (SAEBench's core figures without a second one)."""
    decoder = sae.decoder_weight.detach().float().cpu()
    features = feature_vectors.detach().float().cpu()
    n, f = decoder.shape[0], features.shape[0]
    if features.shape[1] != decoder.shape[1]:
        raise InvalidArgumentError(
            f"the SAE reconstructs width {decoder.shape[1]}, the features have width {features.shape[1]}"
        )
    latent_of, best, mcc = match_latents(decoder, features)
    best_t = torch.from_numpy(best)
    parents = None
    if parent_of is not None and (np.asarray(parent_of) >= 0).any():
        parent_of = np.asarray(parent_of, dtype=np.int64)
        children = torch.from_numpy(np.flatnonzero(parent_of >= 0))
        child_parent = torch.from_numpy(parent_of[children.numpy()])
        parents = (children, child_parent, torch.from_numpy(latent_of))
    sums = _Sums(n, f, features.shape[1])
    was_training = sae.training
    sae.eval()
    try:
        for x, idx, vals in batches:
            _add_batch(sums, sae, x, idx, vals, f, best_t, parents, core)
    finally:
        sae.train(was_training)
    return _result(sums, mcc, best, latent_of, parents)


def _add_batch(sums: _Sums, sae, x, idx, vals, f: int, best: torch.Tensor, parents,
               core) -> None:  # fmt: skip
    x = x.float()
    out = sae(x.to(sae.encoder_weight.device))
    x_hat = out.x_hat.float().cpu()
    dense = dense_code(out, sae.latents_total)
    fires = dense != 0
    if core is not None:
        core.add(x, x_hat, dense)
    truth = dense_truth(idx, vals, f)
    active = truth > 0
    sums.n_samples += x.shape[0]
    sums.true_active += float(active.sum())
    sums.latent_active += float(fires.sum())
    sums.fired |= fires.any(0)
    norms = x.norm(dim=-1)
    valid = norms > MIN_INPUT_NORM
    sums.shrink += float((x_hat.norm(dim=-1)[valid] / norms[valid]).sum())
    sums.shrink_rows += int(valid.sum())
    sums.sum_x += x.sum(0).double()
    sums.sum_sq += float(x.pow(2).sum())
    sums.sum_res += float((x - x_hat).pow(2).sum())
    gt = active[:, best]
    sums.tp += (fires & gt).sum(0).double()
    sums.fp += (fires & ~gt).sum(0).double()
    sums.fn += (~fires & gt).sum(0).double()
    sums.tn += (~fires & ~gt).sum(0).double()
    if parents is not None:
        children, child_parent, latent_of = parents
        matched = latent_of >= 0
        latent_fires = torch.zeros_like(active)
        latent_fires[:, matched] = fires[:, latent_of[matched]]
        # a child that fires and whose latent fires, counted onto its parent
        took = (active[:, children] & latent_fires[:, children]).float()
        by_parent = torch.zeros(x.shape[0], f).index_add_(1, child_parent, took) > 0
        sums.parent_fires += active.sum(0).double()
        sums.absorbed += (active & ~latent_fires & by_parent).sum(0).double()


def _result(sums: _Sums, mcc: float, best: np.ndarray, latent_of: np.ndarray, parents):
    if sums.n_samples == 0:
        raise InvalidArgumentError("no samples to evaluate on")
    m = sums.n_samples
    tp, fp, fn, tn = sums.tp, sums.fp, sums.fn, sums.tn
    precision = torch.where(tp + fp > 0, tp / (tp + fp), 0.0)
    recall = torch.where(tp + fn > 0, tp / (tp + fn), 0.0)
    f1 = torch.where(precision + recall > 0, 2 * precision * recall / (precision + recall), 0.0)
    accuracy = (tp + tn) / (tp + fp + fn + tn).clamp(min=1e-8)
    variance = sums.sum_sq / m - float((sums.sum_x / m).pow(2).sum())
    mse = sums.sum_res / m
    ev = (1.0 if mse < 1e-10 else 0.0) if variance < 1e-10 else 1.0 - mse / variance
    per_parent = {}
    if parents is not None:
        _, child_parent, _ = parents
        for p in sorted(set(child_parent.tolist())):
            if latent_of[p] >= 0 and sums.parent_fires[p] > 0:
                per_parent[p] = float(sums.absorbed[p] / sums.parent_fires[p])
    return GroundTruthMetrics(
        mcc=mcc,
        uniqueness=len(np.unique(best)) / len(best) if len(best) else 0.0,
        precision=float(precision.mean()),
        recall=float(recall.mean()),
        f1=float(f1.mean()),
        accuracy=float(accuracy.mean()),
        explained_variance=ev,
        sae_l0=sums.latent_active / m,
        true_l0=sums.true_active / m,
        dead_latents=int((~sums.fired).sum()),
        shrinkage=sums.shrink / sums.shrink_rows if sums.shrink_rows else 0.0,
        absorption=float(np.mean(list(per_parent.values()))) if per_parent else float("nan"),
        absorption_parents=len(per_parent),
        samples=m,
        per_parent_absorption=per_parent,
    )


def ground_truth_batches(
    dataset: str | os.PathLike, *, rows: int = 0, batch: int = 4096
) -> Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``(x, feature_indices, feature_values)`` batches of the first ``rows`` rows (0: all)
    of a synthetic dataset (``write_synthetic_dataset``), in storage order."""
    from ..torch import ShuffledBatches, open_dataset
    from .job import ACTIVATION, FEATURE_INDICES, FEATURE_VALUES

    ds = open_dataset(dataset)
    columns = [ACTIVATION, FEATURE_INDICES, FEATURE_VALUES]
    missing = [c for c in columns if c not in ds.columns]
    if missing:
        raise InvalidArgumentError(
            f"{dataset}: no column(s) {missing}; a synthetic dataset of write_synthetic_dataset has them"
        )
    reader = ShuffledBatches(ds, batch, columns=columns, shuffle=False, dtype=None,
                             dp_rank=0, dp_size=1)  # fmt: skip
    n = min(len(ds), rows) if rows else len(ds)
    for start in range(0, n, batch):
        got = reader.read_batch(np.arange(start, min(start + batch, n)))
        yield got[ACTIVATION].float(), got[FEATURE_INDICES].long(), got[FEATURE_VALUES].float()
