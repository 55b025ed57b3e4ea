"""From a merged ``LatentState`` to the two tables: one row per latent (statistics and
histogram) and the examples to show (top-N, then random examples per quantile band),
each with its context window's tokens and activations. The Spark job and the
single-process reference both end here, so their outputs agree."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch

from .config import FeaturesConfig
from .state import POS_BITS, LatentState, keep_first, priority, split_ids, token_ids


def latents_table(state: LatentState, config: FeaturesConfig) -> pa.Table:
    """One row per latent: count, frequency, mean and max of its non-zero activations,
    histogram counts, dead / dense flags."""
    n, bins = state.n_latents, state.bins
    counts = state.counts.view(n, bins).numpy()
    fired = counts.sum(1)
    sums = state.sums.view(n, bins).sum(1).numpy()
    frequency = fired / max(state.tokens, 1)
    return pa.table({
        "latent": pa.array(np.arange(n, dtype=np.int32)),
        "count": pa.array(fired.astype(np.int64)),
        "frequency": pa.array(frequency),
        "mean": pa.array(np.where(fired > 0, sums / np.maximum(fired, 1), 0.0)),
        "max": pa.array(state.maxima.numpy().astype(np.float64)),
        "hist": pa.array(list(counts.astype(np.int64)), pa.list_(pa.int64())),
        "dead": pa.array(fired == 0),
        "dense": pa.array(frequency > config.dense_frequency),
    })  # fmt: skip


def examples_table(state: LatentState, config: FeaturesConfig) -> pa.Table:
    """The examples: ``kind`` "top" (rank 0 = the largest) and one kind per quantile band
    (``q0.25-0.50``: tokens drawn uniformly from activations between those quantiles of
    the latent's non-zero activations, bands rounded to whole histogram bins).
    ``context``: the latent's activation on the window's tokens (``state.window`` of
    them, the example's in the middle; 0 where the window has no token)."""
    top = state.top
    order = np.lexsort((top["id"].numpy(), -top["value"].numpy(), top["latent"].numpy()))
    parts = [_rows(top["latent"].numpy()[order], top["value"].numpy()[order],
                   top["id"].numpy()[order], np.array(["top"] * len(order), dtype=object),
                   top["ctx"].numpy()[order])]  # fmt: skip
    if config.samples_per_band and len(config.bands) > 1:
        parts.append(_band_rows(state, config))
    return pa.concat_tables(parts)


def _band_rows(state: LatentState, config: FeaturesConfig) -> pa.Table:
    n, bins, s = state.n_latents, state.bins, state.samples
    counts = state.counts.view(n, bins).double()
    below = (counts.cumsum(1) - counts) / counts.sum(1, keepdim=True).clamp_min(1)
    bands = torch.tensor(config.bands, dtype=torch.float64)
    band = torch.bucketize(below.flatten()[s["cell"]], bands, right=True) - 1
    inside = (band >= 0) & (band < len(config.bands) - 1)
    group = (s["latent"] * len(config.bands) + band)[inside]
    prio = priority(s["id"], s["latent"], state.seed)[inside]
    kept = keep_first(group, prio, s["id"][inside], config.samples_per_band)
    g, p, ids = group[kept].numpy(), prio[kept].numpy(), s["id"][inside][kept].numpy()
    order = np.lexsort((ids, p, g))
    labels = np.array(
        [f"q{lo:.2f}-{hi:.2f}" for lo, hi in zip(config.bands, config.bands[1:], strict=False)],
        dtype=object,
    )
    latents = s["latent"][inside][kept].numpy()[order]
    return _rows(latents, s["value"][inside][kept].numpy()[order], ids[order],
                 labels[g[order] % len(config.bands)], s["ctx"][inside][kept].numpy()[order])  # fmt: skip


def _rows(latents, values, ids, kinds, ctx) -> pa.Table:
    sample_id, window, token_pos = split_ids(ids)
    new = np.ones(len(latents), dtype=bool)
    key = list(zip(latents.tolist(), kinds.tolist(), strict=True))
    new[1:] = [a != b for a, b in zip(key[1:], key[:-1], strict=True)]
    start = np.maximum.accumulate(np.where(new, np.arange(len(new)), 0)) if len(new) else new
    return pa.table({
        "latent": pa.array(latents.astype(np.int32)),
        "kind": pa.array(kinds.tolist(), pa.string()),
        "rank": pa.array((np.arange(len(new)) - start).astype(np.int32)),
        "value": pa.array(values.astype(np.float32)),
        "sample_id": pa.array(sample_id),
        "window": pa.array(window.astype(np.int32)),
        "token_pos": pa.array(token_pos.astype(np.int32)),
        "context": list_array(ctx.astype(np.float32).reshape(-1), np.full(len(ctx), ctx.shape[1])),
    })  # fmt: skip


def list_array(values, lengths) -> pa.ListArray:
    """A list column of ``values`` cut into consecutive lists of ``lengths``."""
    offsets = np.zeros(len(lengths) + 1, np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), values)


def contexts_table(examples: pa.Table, tokens: pa.Table, context: int) -> pa.Table:
    """One row per example, sorted by latent, kind and rank: its window of +-``context``
    tokens (``tokens``: their text; ``acts``: the latent's activation on each; ``center``:
    the example token's index). ``tokens`` holds the windows' tokens (``sample_id,
    window, pos, token``); a position without a token (before the start, past the end)
    is left out."""
    examples = examples.sort_by([(c, "ascending") for c in ("latent", "kind", "rank")])
    have = token_ids(*(tokens.column(c).to_numpy().astype(np.int64)
                       for c in ("sample_id", "window", "pos")))  # fmt: skip
    order = np.argsort(have, kind="stable")
    have = have[order]
    pos = examples.column("token_pos").to_numpy().astype(np.int64)
    base = token_ids(*(examples.column(c).to_numpy().astype(np.int64)
                       for c in ("sample_id", "window", "token_pos")))  # fmt: skip
    offsets = np.arange(-context, context + 1)
    inside = (pos[:, None] + offsets >= 0) & (pos[:, None] + offsets < 1 << POS_BITS)
    want = base[:, None] + offsets
    at = np.minimum(np.searchsorted(have, want), max(len(have) - 1, 0))
    found = inside & (have[at] == want) if len(have) else np.zeros_like(inside)
    ctx = examples.column("context").combine_chunks().flatten().to_numpy(zero_copy_only=False)
    acts = ctx.astype(np.float32).reshape(len(pos), len(offsets))[found]
    text = tokens.column("token").take(pa.array(order[at[found]]))
    lengths = found.sum(1)
    center = np.where(found[:, context], found[:, :context].sum(1), -1)  # -1: no such token
    return (
        examples.drop(["context"])
        .append_column("tokens", list_array(text.combine_chunks(), lengths))
        .append_column("acts", list_array(acts, lengths))
        .append_column("center", pa.array(center.astype(np.int32)))
    )
