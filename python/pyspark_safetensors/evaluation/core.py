"""SAEBench's core figures that need no language model (``sae_bench/evals/core``,
SAEBench 0.6.0), for any SAE of ``sae/architectures`` on any activations: how it
reconstructs, how much it shrinks, how sparse it is, how its latents' firing is spread,
and how its dictionary is laid out.

On rows ``x`` with reconstructions ``x_hat`` and codes ``z`` (``z_i != 0`` where latent
``i`` fires):

- reconstruction: ``explained_variance`` = ``1 - E|x - x_hat|^2 / (E|x|^2 - |E x|^2)``
  (float64 sums, as ``groundtruth``'s), ``mse`` the mean squared error per element,
  ``cossim`` the mean ``cos(x, x_hat)``;
- shrinkage: ``l2_norm_in`` and ``l2_norm_out`` the mean ``|x|`` and ``|x_hat|``,
  ``l2_ratio`` the mean ``|x_hat| / |x|`` (a row with ``|x| < 1e-4`` divided by 1, as
  SAEBench does), ``relative_reconstruction_bias`` = ``E|x_hat|^2 / E<x, x_hat>`` (1: no
  shrinkage; Eq. 10 of Rajamanoharan et al. 2024);
- sparsity: ``l0`` the mean number of latents firing, ``l1`` the mean sum of the code;
- firing: ``feature_density`` (per latent: the share of rows where ``z_i > 0``),
  ``frac_alive`` (latents firing at least once), ``freq_over_1_percent`` and
  ``freq_over_10_percent`` (latents denser than that), and ``normalized_freq_over_...``
  (their share of all firings);
- the dictionary, from the weights alone: per latent ``encoder_norm``, ``encoder_bias``,
  ``encoder_decoder_cosine_sim`` (its encoder row against its decoder row) and
  ``max_encoder_cosine_sim`` / ``max_decoder_cosine_sim`` (against the closest other
  latent's row), and their means ``average_max_encoder_cosine_sim`` and
  ``average_max_decoder_cosine_sim`` (high: latents that duplicate each other).

Where we differ from SAEBench: its ``mse`` divides each row's squared error by the
batch's token count (a figure that changes with the batch size); ours is per element. Its
``consistent_activation_heuristic`` needs prompts of several tokens and is not computed
here. The figures that need the model (CE loss and KL with the SAE spliced in) are the
pipeline's ``evaluation`` stage's.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from ..format.errors import InvalidArgumentError

#: Input norms below this are divided by 1 in ``l2_ratio`` (SAEBench's).
L2_RATIO_FLOOR = 1e-4
#: Latents compared at once for the closest-row cosines.
COSINE_CHUNK = 1024


@dataclass(frozen=True)
class CoreMetrics:
    """An SAE's core figures (module docstring); the per-latent ones as lists."""

    explained_variance: float
    mse: float
    cossim: float
    l2_norm_in: float
    l2_norm_out: float
    l2_ratio: float
    relative_reconstruction_bias: float
    l0: float
    l1: float
    frac_alive: float
    freq_over_1_percent: float
    freq_over_10_percent: float
    normalized_freq_over_1_percent: float
    normalized_freq_over_10_percent: float
    average_max_encoder_cosine_sim: float
    average_max_decoder_cosine_sim: float
    samples: int
    per_latent: dict[str, list[float]] = field(default_factory=dict, repr=False)

    def to_dict(self, *, per_latent: bool = False) -> dict:
        """The figures, JSON-ready; the per-latent lists only when asked."""
        out = asdict(self)
        if not per_latent:
            out.pop("per_latent")
        return out


def dense_code(out, n_latents: int) -> torch.Tensor:
    """``[B, n_latents]`` on the CPU: an SAE forward's sparse code (``out.values`` at
    ``out.indices``) scattered out, 0 where a latent is silent."""
    code = torch.zeros(out.values.shape[0], n_latents)
    return code.scatter_add_(1, out.indices.cpu().long(), out.values.float().cpu())


def max_cosine_to_others(rows_NH: torch.Tensor, chunk: int = COSINE_CHUNK) -> torch.Tensor:
    """``[N]``: each row's largest cosine with any other row (``-1`` when alone), in
    chunks of ``chunk`` rows, never an ``N x N`` matrix."""
    unit = torch.nn.functional.normalize(rows_NH.detach().float(), dim=1)
    n = unit.shape[0]
    out = torch.full((n,), -1.0)
    for start in range(0, n, chunk):
        sims = unit[start : start + chunk] @ unit.T
        rows = torch.arange(sims.shape[0])
        sims[rows, rows + start] = -float("inf")  # not itself
        if n > 1:
            out[start : start + chunk] = sims.max(1).values
    return out


class CoreSums:
    """Running sums of the streamed figures: ``add`` each batch's rows, their
    reconstructions and dense codes; ``result`` adds the weights' figures."""

    def __init__(self, n_latents: int):
        self.n_latents = n_latents
        self.rows = 0
        self.width = 0
        self.sum_x = None
        self.sum_sq = self.sum_res = self.sum_cos = 0.0
        self.norm_in = self.norm_out = self.ratio = 0.0
        self.out_sq = self.dot = 0.0
        self.active = self.code_sum = 0.0
        self.fires = torch.zeros(n_latents, dtype=torch.float64)

    def add(self, x: torch.Tensor, x_hat: torch.Tensor, code: torch.Tensor) -> None:
        """One batch: ``x`` and ``x_hat [B, H]``, ``code [B, n_latents]`` (0: silent)."""
        x, x_hat, code = x.double(), x_hat.double(), code.double()
        if self.sum_x is None:
            self.width, self.sum_x = x.shape[1], torch.zeros(x.shape[1], dtype=torch.float64)
        self.rows += x.shape[0]
        self.sum_x += x.sum(0)
        self.sum_sq += float(x.pow(2).sum())
        self.sum_res += float((x - x_hat).pow(2).sum())
        n_in, n_out = x.norm(dim=1), x_hat.norm(dim=1)
        self.sum_cos += float(torch.nn.functional.cosine_similarity(x, x_hat, dim=1).sum())
        self.norm_in += float(n_in.sum())
        self.norm_out += float(n_out.sum())
        self.ratio += float((n_out / torch.where(n_in < L2_RATIO_FLOOR, 1.0, n_in)).sum())
        self.out_sq += float(n_out.pow(2).sum())
        self.dot += float((x * x_hat).sum())
        self.active += float((code != 0).sum())
        self.code_sum += float(code.sum())
        self.fires += (code > 0).sum(0).double()

    def result(self, sae) -> CoreMetrics:
        """The figures of the rows added, with those of ``sae``'s weights."""
        if self.rows == 0:
            raise InvalidArgumentError("no samples to evaluate on")
        m = self.rows
        variance = self.sum_sq / m - float((self.sum_x / m).pow(2).sum())
        mse_row = self.sum_res / m
        ev = (1.0 if mse_row < 1e-10 else 0.0) if variance < 1e-10 else 1.0 - mse_row / variance
        density = self.fires / m
        total = float(density.sum())

        def share(mask):
            return float(density[mask].sum()) / total if total > 0 else 0.0

        weights = dictionary_figures(sae)
        return CoreMetrics(
            explained_variance=ev,
            mse=mse_row / self.width,
            cossim=self.sum_cos / m,
            l2_norm_in=self.norm_in / m,
            l2_norm_out=self.norm_out / m,
            l2_ratio=self.ratio / m,
            relative_reconstruction_bias=self.out_sq / self.dot if self.dot else float("nan"),
            l0=self.active / m,
            l1=self.code_sum / m,
            frac_alive=float((density > 0).double().mean()),
            freq_over_1_percent=float((density > 0.01).double().mean()),
            freq_over_10_percent=float((density > 0.1).double().mean()),
            normalized_freq_over_1_percent=share(density > 0.01),
            normalized_freq_over_10_percent=share(density > 0.1),
            average_max_encoder_cosine_sim=float(np.mean(weights["max_encoder_cosine_sim"])),
            average_max_decoder_cosine_sim=float(np.mean(weights["max_decoder_cosine_sim"])),
            samples=m,
            per_latent={"feature_density": density.tolist(), **weights},
        )


def dictionary_figures(sae) -> dict[str, list[float]]:
    """Per latent, from the weights: ``encoder_norm``, ``encoder_bias``,
    ``encoder_decoder_cosine_sim``, ``max_encoder_cosine_sim``, ``max_decoder_cosine_sim``.
    An encoder and decoder of different widths (a transcoder) have no
    ``encoder_decoder_cosine_sim`` (NaN)."""
    enc = sae.encoder_weight.detach().float().cpu()
    dec = sae.decoder_weight.detach().float().cpu()
    if enc.shape[1] == dec.shape[1]:
        enc_dec = torch.nn.functional.cosine_similarity(enc, dec, dim=1).tolist()
    else:
        enc_dec = [float("nan")] * enc.shape[0]
    return {
        "encoder_norm": enc.norm(dim=1).tolist(),
        "encoder_bias": sae.encoder_bias.detach().float().cpu().tolist(),
        "encoder_decoder_cosine_sim": enc_dec,
        "max_encoder_cosine_sim": max_cosine_to_others(enc).tolist(),
        "max_decoder_cosine_sim": max_cosine_to_others(dec).tolist(),
    }


@torch.no_grad()
def core_metrics(sae, batches: Iterable[torch.Tensor]) -> CoreMetrics:
    """The core figures of ``sae`` (in eval mode: a BatchTopK SAE encodes by its
    threshold) on ``batches`` of rows ``[B, H]``."""
    sums = CoreSums(sae.latents_total)
    was_training = sae.training
    sae.eval()
    try:
        for x in batches:
            out = sae(x.float().to(sae.encoder_weight.device))
            sums.add(x, out.x_hat.float().cpu(), dense_code(out, sae.latents_total))
    finally:
        sae.train(was_training)
    return sums.result(sae)
