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
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .config import FeaturesError

GROUND_TRUTH_FILE = "ground_truth.parquet/part-00000.parquet"
FACTOR_KEYS = ("image_id", "key", "path")
"""The columns a factor table may name its images by (the first it has): the
extraction's ``image_id``, or the image's ``key`` (a ``path`` column is matched against
``images.parquet``'s key, then its path)."""


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


def factor_columns(schema: pa.Schema) -> tuple[str, ...]:
    """The factors of a label table: its string columns but the image's name."""
    strings = (pa.types.is_string, pa.types.is_large_string)
    return tuple(f.name for f in schema
                 if f.name not in FACTOR_KEYS and any(t(f.type) for t in strings))  # fmt: skip


def factor_masks(
    labels: pa.Table, factors: tuple[str, ...] = ()
) -> dict[tuple[str, str], np.ndarray]:
    """``{(factor, value): inside [n]}`` from a per-patch label table: one row per patch,
    a string column per factor holding the value of the shape the patch lies in (null
    outside any shape). ``factors``: the columns to use (default: every string column but
    the image's name, ``FACTOR_KEYS``)."""
    names = factors or factor_columns(labels.schema)
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


@dataclass
class FactorLabels:
    """A factor table resolved against an extraction: the token id of each labelled patch
    (``state.token_ids``, in the table's order) and the masks of ``factor_masks``."""

    ids: np.ndarray
    masks: dict[tuple[str, str], np.ndarray]


def read_factors(path: str, layout, images: pa.Table | None = None) -> FactorLabels:
    """The factor table at ``path`` (parquet), its patches numbered by the extraction's
    ``layout``. Either one row per patch: ``patch_row``, ``patch_col`` and a string
    column per factor holding the value of the shape the patch lies in (null outside); or
    one row per image: ``patch_mask`` (a bool per patch, row-major: inside the shape) and
    a string column per factor (its value, for the patches of the mask), as
    ``extract.toy_vit.write_image_set`` writes its ``labels.parquet``. Images are named by
    a ``FACTOR_KEYS`` column; ``images`` (``image_id``, ``key``, ``path`` of the
    extraction's ``images.parquet``) resolves a key or a path."""
    import pyarrow.parquet as pq

    from .state import token_ids

    labels = pq.read_table(path)
    names = labels.column_names
    name = next((c for c in FACTOR_KEYS if c in names), None)
    per_patch = "patch_row" in names and "patch_col" in names
    if name is None or not (per_patch or "patch_mask" in names):
        raise FeaturesError(f"{path}: a factor table needs image_id (or key, or path) and "
                            f"patch_row and patch_col, or patch_mask; it has {names}")  # fmt: skip
    if not per_patch:
        labels = _patches_of(labels, layout, path)
    if name == "image_id":
        image_id = labels.column("image_id").to_numpy().astype(np.int64)
    else:
        image_id = _image_ids(labels.column(name).to_pylist(), images, path)
    labels = labels.drop([c for c in FACTOR_KEYS if c in labels.column_names])
    row = labels.column("patch_row").to_numpy().astype(np.int64)
    col = labels.column("patch_col").to_numpy().astype(np.int64)
    if ((row < 0) | (row >= layout.rows) | (col < 0) | (col >= layout.cols)).any():
        raise FeaturesError(f"{path}: patches outside the {layout.rows}x{layout.cols} patch grid")
    ids = token_ids(image_id, np.zeros_like(image_id), layout.position(row, col))
    if len(np.unique(ids)) != len(ids):
        raise FeaturesError(f"{path}: a patch is labelled twice")
    masks = factor_masks(labels.drop(["patch_row", "patch_col"]))
    if not masks:
        raise FeaturesError(f"{path}: no factor column with a value")
    return FactorLabels(ids, masks)


def _patches_of(labels: pa.Table, layout, path: str) -> pa.Table:
    """A per-image table (``patch_mask``) as one row per patch of the grid, each factor
    null outside the mask."""
    n = layout.rows * layout.cols
    mask = labels.column("patch_mask").combine_chunks()
    if (pc.list_value_length(mask).to_numpy(zero_copy_only=False) != n).any():
        raise FeaturesError(
            f"{path}: patch_mask must hold {n} patches ({layout.rows}x{layout.cols})"
        )
    inside = mask.flatten().to_numpy(zero_copy_only=False).astype(bool)
    image = np.repeat(np.arange(labels.num_rows), n)
    columns = {name: labels.column(name).take(pa.array(image)) for name in labels.column_names
               if name not in ("patch_mask", "patch_coverage")}  # fmt: skip
    for name in factor_columns(labels.schema):
        columns[name] = pc.if_else(pa.array(inside), columns[name], None)
    patch = np.tile(np.arange(n), labels.num_rows)
    columns["patch_row"] = pa.array(patch // layout.cols)
    columns["patch_col"] = pa.array(patch % layout.cols)
    return pa.table(columns)


def _image_ids(names: list, images: pa.Table | None, path: str) -> np.ndarray:
    """The ``image_id`` of images named by key (or path) in ``images``."""
    if images is None:
        raise FeaturesError(f"{path}: images named by key need the extraction's images.parquet")
    found = {}
    for column in ("path", "key"):  # a key wins over a path
        if column in images.column_names:
            found |= dict(zip(images.column(column).to_pylist(),
                              images.column("image_id").to_pylist(), strict=True))  # fmt: skip
    unknown = [k for k in names if k not in found]
    if unknown:
        raise FeaturesError(f"{path}: {len(set(unknown))} images not in the extraction "
                            f"({unknown[0]!r})")  # fmt: skip
    return np.asarray([found[k] for k in names], np.int64)


class PatchCodes:
    """The SAE's code of chosen tokens, kept while a scan passes them (``tap``)."""

    def __init__(self, ids: np.ndarray):
        self.ids = np.unique(np.asarray(ids, np.int64))
        self.parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.seen = 0
        """Chosen tokens met (a check that every labelled patch was found)."""

    def tap(self, chunk):
        """Keep the firing entries of ``chunk``'s chosen tokens; return the chunk."""
        ids = chunk.ids.cpu().numpy()
        rows = np.flatnonzero(np.isin(ids, self.ids))
        if len(rows):
            self.seen += len(rows)
            values = chunk.values[rows].float().cpu().numpy()
            indices = chunk.indices[rows].long().cpu().numpy()
            fired = values > 0
            token = np.broadcast_to(ids[rows][:, None], values.shape)[fired]
            self.parts.append((token, indices[fired], values[fired]))
        return chunk

    def entries(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(token, latent, value)`` of every firing entry kept."""
        if not self.parts:
            return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32)
        return tuple(np.concatenate(p) for p in zip(*self.parts, strict=True))


def code_matrix(ids: np.ndarray, token: np.ndarray, latent: np.ndarray, value: np.ndarray):
    """``values, indices [n, m]`` of the tokens ``ids`` (in that order) from firing entries
    ``(token, latent, value)``; a token without entries is all silent."""
    ids = np.asarray(ids, np.int64)
    row = np.searchsorted(np.sort(ids), token)
    row = np.argsort(ids, kind="stable")[np.minimum(row, len(ids) - 1)]
    if len(token) and not np.array_equal(ids[row], token):
        raise FeaturesError("codes of tokens that were not labelled")
    order = np.argsort(row, kind="stable")
    row, latent, value = row[order], np.asarray(latent)[order], np.asarray(value)[order]
    counts = np.bincount(row, minlength=len(ids))
    m = max(int(counts.max()) if len(counts) else 0, 1)
    slot = np.arange(len(row)) - np.repeat(np.cumsum(counts) - counts, counts)
    values = np.zeros((len(ids), m), np.float32)
    indices = np.zeros((len(ids), m), np.int64)
    values[row, slot], indices[row, slot] = value, latent
    return values, indices
