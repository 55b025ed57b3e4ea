"""Ground truth for an SAE of image patches: given which patches of held-out images lie
inside a shape whose generative factor has a value (``shape = "circle"``, ``colour =
"red"``, ...), the single latent whose activation best separates those patches from all
the others, scored by AUROC.

AUROC is computed exactly from the SAE's sparse code (no sampling, no thresholds): for a
latent, the probability that a random positive patch activates it more than a random
negative one, ties counted one half (the Mann-Whitney U statistic over midranks). A
latent that does not fire on a patch scores 0 there, so every silent patch ties; the sums
run over the firing entries only, ``O(entries log entries)`` for all latents together.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pyarrow as pa

from .config import FeaturesError

GROUND_TRUTH_FILE = "ground_truth.parquet/part-00000.parquet"
FACTOR_KEYS = ("image_id", "key")
"""The columns a factor table may name its images by (one of them), beside
``patch_row`` and ``patch_col``."""


def auroc_dense(scores: np.ndarray, positive: np.ndarray) -> np.ndarray:
    """AUROC of each column of ``scores [n, L]`` for the boolean ``positive [n]`` (ties one
    half), by midranks; NaN when one class is empty. The direct formula, for dense scores."""
    scores = np.asarray(scores, np.float64)
    scores = scores.reshape(len(scores), -1)
    positive = np.asarray(positive, bool)
    n, p = len(positive), int(positive.sum())
    if p == 0 or p == n:
        return np.full(scores.shape[1], np.nan)
    order = np.argsort(scores, axis=0, kind="stable")
    s = np.take_along_axis(scores, order, 0)
    ranks = np.arange(1, n + 1, dtype=np.float64)[:, None]
    new = np.ones_like(s, dtype=bool)
    new[1:] = s[1:] != s[:-1]
    first = np.maximum.accumulate(np.where(new, ranks, 0), axis=0)
    last_flags = np.ones_like(new)
    last_flags[:-1] = new[1:]
    last = np.minimum.accumulate(np.where(last_flags, ranks, n + 1)[::-1], axis=0)[::-1]
    midrank = (first + last) / 2
    rank_sum = (midrank * positive[order]).sum(0)
    return (rank_sum - p * (p + 1) / 2) / (p * (n - p))


def auroc_sparse(
    values: np.ndarray, indices: np.ndarray, positive: np.ndarray, n_latents: int
) -> np.ndarray:
    """AUROC of every latent for ``positive [n]`` from a sparse code (``values, indices
    [n, m]``: latent ``indices[i, j]`` fires ``values[i, j]`` on patch i; entries <= 0 are
    silent), exactly as ``auroc_dense`` of the dense code: the silent patches of a latent
    share one midrank, its firing ones rank above them. NaN when one class is empty."""
    values = np.asarray(values, np.float64).reshape(len(positive), -1)
    indices = np.asarray(indices, np.int64).reshape(values.shape)
    positive = np.asarray(positive, bool)
    n, p = len(positive), int(positive.sum())
    if p == 0 or p == n:
        return np.full(n_latents, np.nan)
    fired = values > 0
    lat, val = indices[fired], values[fired]
    pos = np.broadcast_to(positive[:, None], values.shape)[fired]
    order = np.lexsort((val, lat))
    lat, val, pos = lat[order], val[order], pos[order]
    m = len(lat)
    nnz = np.bincount(lat, minlength=n_latents)
    zeros = n - nnz  # silent patches per latent
    start = np.zeros(n_latents + 1, np.int64)
    np.cumsum(nnz, out=start[1:])
    # rank of each firing entry among its latent's firing entries (1-based), midranks on ties
    i = np.arange(m, dtype=np.float64) - start[lat] + 1
    new = np.ones(m, bool)
    new[1:] = (lat[1:] != lat[:-1]) | (val[1:] != val[:-1])
    end = np.ones(m, bool)
    end[:-1] = new[1:]
    first = np.maximum.accumulate(np.where(new, np.arange(m), 0))
    last = np.minimum.accumulate(np.where(end, np.arange(m), m)[::-1])[::-1]
    midrank = (i[first] + i[last]) / 2 + zeros[lat]
    pos_fired = np.bincount(lat, weights=pos.astype(np.float64), minlength=n_latents)
    rank_sum = np.bincount(lat, weights=midrank * pos, minlength=n_latents)
    rank_sum += (p - pos_fired) * (zeros + 1) / 2  # silent positives: the zeros' midrank
    return (rank_sum - p * (p + 1) / 2) / (p * (n - p))


def factor_masks(
    labels: pa.Table, factors: tuple[str, ...] = ()
) -> dict[tuple[str, str], np.ndarray]:
    """``{(factor, value): inside [n]}`` from a per-patch label table: one row per patch,
    a string column per factor holding the value of the shape the patch lies in (null
    outside any shape). ``factors``: the columns to use (default: every column but the
    patch's address, ``image_id``/``key``, ``patch_row``, ``patch_col``)."""
    address = {*FACTOR_KEYS, "patch_row", "patch_col"}
    names = factors or tuple(c for c in labels.column_names if c not in address)
    masks = {}
    for factor in names:
        if factor not in labels.column_names:
            raise FeaturesError(f"factor table has no column {factor!r} ({labels.column_names})")
        column = np.asarray(labels.column(factor).to_pylist(), dtype=object)
        for value in sorted({v for v in column if v is not None}, key=str):
            masks[(factor, str(value))] = column == value
    return masks


def ground_truth_table(
    values: np.ndarray, indices: np.ndarray, masks: Mapping[tuple[str, str], np.ndarray],
    n_latents: int,
) -> pa.Table:  # fmt: skip
    """One row per (factor, value): the latent of highest AUROC at telling the patches
    inside a shape of that value from every other patch (ties: the smaller latent),
    its ``auroc``, the runner-up's (``second_auroc``, how unique the detector is), the
    latent's activation rate inside and outside, and the counts of ``positives`` and
    ``negatives``. ``values, indices [n, m]``: the SAE's code of the n labelled patches."""
    rows: dict[str, list] = {c: [] for c in ("factor", "value", "latent", "auroc", "second_auroc",
                                             "fires_inside", "fires_outside", "positives",
                                             "negatives")}  # fmt: skip
    values = np.asarray(values).reshape(len(values), -1)
    indices = np.asarray(indices).reshape(values.shape)
    for (factor, value), inside in masks.items():
        inside = np.asarray(inside, bool)
        scores = auroc_sparse(values, indices, inside, n_latents)
        if np.isnan(scores).all():
            continue
        ranked = np.lexsort((np.arange(n_latents), -np.nan_to_num(scores, nan=-1.0)))
        best = int(ranked[0])
        fires = ((indices == best) & (values > 0)).any(1)
        rows["factor"].append(factor)
        rows["value"].append(value)
        rows["latent"].append(best)
        rows["auroc"].append(float(scores[best]))
        rows["second_auroc"].append(float(scores[ranked[1]]) if n_latents > 1 else float("nan"))
        rows["fires_inside"].append(float(fires[inside].mean()))
        rows["fires_outside"].append(float(fires[~inside].mean()))
        rows["positives"].append(int(inside.sum()))
        rows["negatives"].append(int((~inside).sum()))
    return pa.table({
        "factor": pa.array(rows["factor"], pa.string()),
        "value": pa.array(rows["value"], pa.string()),
        "latent": pa.array(rows["latent"], pa.int32()),
        **{c: pa.array(rows[c], pa.float64()) for c in ("auroc", "second_auroc", "fires_inside",
                                                        "fires_outside")},
        "positives": pa.array(rows["positives"], pa.int64()),
        "negatives": pa.array(rows["negatives"], pa.int64()),
    })  # fmt: skip
