"""Held-out evaluation of an SAE (or a transcoder, a crosscoder): FVU (of the target),
L0, dead and dense latents and the latent frequencies on activations it never trained on (other texts, never other tokens of
the same text), and ``split_by_sample`` to make such a split from one dataset."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

from ..format.errors import InvalidArgumentError
from ..torch import ShuffledBatches, open_dataset
from .mesh import MODEL, all_reduce
from .model import TopKSAE

#: A latent firing on more than this fraction of tokens counts as dense.
DENSE_FREQUENCY = 0.1


def held_out_batches(
    dataset: str | os.PathLike, column: str = "activation", *, tokens: int = 0, batch: int = 4096
) -> Iterable[torch.Tensor]:
    """The first ``tokens`` rows (0 = all) of a batch-mode dataset, in storage order,
    as float32 ``[<=batch, d]`` tensors (every rank reads the same rows)."""
    ds = open_dataset(dataset)
    if column not in ds.columns:
        raise InvalidArgumentError(f"{dataset}: no column {column!r}; it has {ds.columns}")
    reader = ShuffledBatches(ds, batch, columns=[column], shuffle=False, dp_rank=0, dp_size=1)
    n = min(len(ds), tokens) if tokens else len(ds)
    for start in range(0, n, batch):
        yield reader.read_batch(np.arange(start, min(start + batch, n)))[column]


@torch.no_grad()
def evaluate_sae(
    sae: TopKSAE, batches: Iterable[torch.Tensor | tuple[torch.Tensor, torch.Tensor]], mesh=None
) -> dict:
    """``{fvu, l0, dead_fraction, dense_fraction, tokens, frequency}`` of ``sae`` on
    ``batches`` (``frequency``: per-latent firing rate, a float64 numpy array over every
    latent), plus ``fvu_<part>`` for each part an architecture reports
    (``evaluation_parts``: a Matryoshka SAE's prefixes, a crosscoder's hook points, a
    cross-layer transcoder's target layers), and ``l0_<group>`` and
    ``dead_fraction_<group>`` for each group of latents it names (``latent_groups``: a
    cross-layer transcoder's layers). A
    batch is ``x`` (an SAE reconstructs it) or a pair ``(x, y)`` (a transcoder: the FVU is
    that of ``y``). A collective over "model" when the SAE is sharded; every rank passes
    the same batches."""
    was_training = sae.training
    sae.eval()  # BatchTopK encodes by its threshold, as in use
    try:
        return _evaluate(sae, batches, mesh)
    finally:
        sae.train(was_training)


class _FVU:
    """Running sums of one reconstruction's FVU: of y, of y^2 and of the squared error."""

    def __init__(self, d: int, device):
        self.sums = torch.zeros(d + 2, dtype=torch.float64, device=device)

    def add(self, y_hat: torch.Tensor, y: torch.Tensor) -> None:
        d = y.shape[1]
        self.sums[:d] += y.sum(0).double()
        self.sums[d] += y.double().pow(2).sum()
        self.sums[d + 1] += (y_hat.float() - y).double().pow(2).sum()

    def fvu(self, n: float) -> float:
        d = self.sums.shape[0] - 2
        var = float(self.sums[d] - self.sums[:d].pow(2).sum() / n)
        return float(self.sums[d + 1]) / max(var, 1e-30)


def _evaluate(sae: TopKSAE, batches, mesh) -> dict:
    device = sae.encoder_weight.device
    whole: _FVU | None = None  # of the whole target (a CLT's: every layer's, concatenated)
    parts: dict[str, _FVU] = {}
    counts = torch.zeros(2, dtype=torch.float64, device=device)  # active latents, tokens
    fired = torch.zeros(sae.n_local, dtype=torch.float64, device=device)
    for batch in batches:
        x, y = batch if isinstance(batch, (tuple, list)) else (batch, batch)
        x = x.to(device, torch.float32)
        y = x if y is batch or y is x else y.to(device, torch.float32)
        out = sae(x)
        whole = whole or _FVU(y.shape[1], device)
        whole.add(out.x_hat, y)
        for name, (part_hat, part_y) in sae.evaluation_parts(out, y).items():
            parts.setdefault(name, _FVU(part_y.shape[1], device)).add(part_hat, part_y)
        active = out.values > 0
        counts[0] += active.sum()
        counts[1] += x.shape[0]
        local = sae.local_latents(out.indices)[active]
        fired += torch.bincount(local, minlength=sae.n_local).double()
    n = float(counts[1])
    if n == 0:
        raise InvalidArgumentError("no held-out rows to evaluate on")
    l0 = all_reduce(counts[:1].clone(), mesh, MODEL)[0]
    freq = (sae.gather_latents(fired) / n).cpu().numpy()
    groups = {}
    for name, latents in sae.latent_groups().items():  # a group's L0 is its frequencies' sum
        groups[f"l0_{name}"] = float(freq[latents].sum())
        groups[f"dead_fraction_{name}"] = float((freq[latents] == 0).mean())
    return {
        "fvu": whole.fvu(n),
        **{f"fvu_{name}": part.fvu(n) for name, part in parts.items()},
        **groups,
        "l0": float(l0) / n,
        "dead_fraction": float((freq == 0).mean()),
        "dense_fraction": float((freq > DENSE_FREQUENCY).mean()),
        "tokens": int(n),
        "frequency": freq,
    }


def split_by_sample(
    dataset: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    val_fraction: float = 0.1,
    sample_column: str = "sample_id",
    seed: int = 0,
) -> tuple[Path, Path]:
    """Write ``out_dir/train`` and ``out_dir/val`` from a token-level dataset, putting
    every token of a sample (a text) on the same side; returns both paths."""
    from ..dataset import write_batch_dataset

    if not 0 < val_fraction < 1:
        raise InvalidArgumentError(f"val_fraction must be in (0, 1), got {val_fraction}")
    ds = open_dataset(dataset)
    if sample_column not in ds.columns:
        raise InvalidArgumentError(
            f"{dataset}: no column {sample_column!r} to split by; it has {ds.columns} "
            "(give sample_column, or a separate held-out dataset)"
        )
    rows = ShuffledBatches(ds, max(len(ds), 1), shuffle=False, dtype=None, dp_rank=0, dp_size=1)
    columns = {k: v.numpy() for k, v in rows.read_batch(np.arange(len(ds))).items()}
    samples = np.unique(columns[sample_column])
    n_val = max(1, round(len(samples) * val_fraction))
    if n_val >= len(samples):
        raise InvalidArgumentError(
            f"{dataset}: {len(samples)} sample(s) are too few to hold some out"
        )
    held = np.random.default_rng(seed).choice(samples, size=n_val, replace=False)
    is_val = np.isin(columns[sample_column], held)
    out = Path(out_dir)
    paths = []
    for name, keep in (("train", ~is_val), ("val", is_val)):
        paths.append(out / name)
        write_batch_dataset(
            paths[-1], {k: v[keep] for k, v in columns.items()}, metadata=dict(ds.metadata)
        )
    return paths[0], paths[1]
