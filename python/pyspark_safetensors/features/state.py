"""Per-latent state of one stream of tokens, bounded whatever the stream's length, and
mergeable: two states of disjoint token sets merge into the state of their union.

- statistics: non-zero count and sum per (latent, histogram bin), max per latent, tokens;
- top-N: the N largest activations of each latent, ties broken by the token id (so the
  lists do not depend on how the tokens were split between tasks); with ``distinct``
  (images) the N samples of largest activation, each by its largest token, so one
  image's many patches do not fill a latent's list;
- random examples: per (latent, histogram bin) the R entries with the smallest hash
  priority (bottom-k sampling: a uniform sample without replacement, and the bottom-k of a
  union is the bottom-k of the parts' bottom-k, so any band made of whole bins can be
  sampled exactly after the merge);
- each kept entry's context window (``ctx``): the latent's activation on the tokens
  around it, taken from the batch when the entry is kept, carried through merges.

Every update is a handful of vectorised torch operations over the batch's sparse code;
memory is O(latents x (N + bins x R) x window).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .config import FeaturesError

POS_BITS, WINDOW_BITS = 12, 16
"""A token's id: ``sample_id << 28 | window << 12 | token_pos`` (one int64, ordered like
the dataset)."""
_U32 = 1 << 32
_MIX = (-49064778989728563, -4265267296055464877)  # murmur3's finalizer, as signed int64


def token_ids(sample_id: np.ndarray, window: np.ndarray, token_pos: np.ndarray) -> np.ndarray:
    """The int64 id of each token (see ``POS_BITS``)."""
    if token_pos.size and (token_pos.max() >= 1 << POS_BITS or window.max() >= 1 << WINDOW_BITS):
        raise FeaturesError(
            f"token_pos must be < {1 << POS_BITS} and window < {1 << WINDOW_BITS} to number tokens"
        )
    return (
        (sample_id.astype(np.int64) << (POS_BITS + WINDOW_BITS))
        | (window.astype(np.int64) << POS_BITS)
        | token_pos.astype(np.int64)
    )


def split_ids(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(sample_id, window, token_pos)`` of token ids."""
    ids = np.asarray(ids, np.int64)
    return (
        ids >> (POS_BITS + WINDOW_BITS),
        (ids >> POS_BITS) & ((1 << WINDOW_BITS) - 1),
        ids & ((1 << POS_BITS) - 1),
    )


def priority(ids: torch.Tensor, latents: torch.Tensor, seed: int) -> torch.Tensor:
    """A pseudo-random 31-bit priority per (token, latent): a hash, so the same entry gets
    the same priority in any task (int64 products wrap, as the hash wants)."""
    x = ids * 1_000_003 + latents * 2_654_435_761 + seed
    for c in _MIX:
        x = (x ^ ((x >> 33) & ((1 << 31) - 1))) * c
    return (x >> 32) & 0x7FFFFFFF


def keep_first(group: torch.Tensor, key: torch.Tensor, ids: torch.Tensor, per_group: int):
    """Indices of the ``per_group`` entries of each group with the smallest ``key``
    (``0 <= key < 2**32``), ties by the smaller id: two stable sorts, no Python loop."""
    if group.numel() == 0:
        return group
    by_id = torch.sort(ids, stable=True).indices
    composite = group[by_id] * _U32 + key[by_id]
    order = by_id[torch.sort(composite, stable=True).indices]
    g = group[order]
    n = g.numel()
    arange = torch.arange(n, device=g.device)
    new = torch.ones(n, dtype=torch.bool, device=g.device)
    new[1:] = g[1:] != g[:-1]
    start = torch.cummax(torch.where(new, arange, 0), 0).values
    return order[(arange - start) < per_group]


def best_per_sample(latents: torch.Tensor, values: torch.Tensor, ids: torch.Tensor):
    """Indices of the largest entry of each (latent, sample) (ties: the smaller id), by
    stable sorts: id, descending value, sample, latent."""
    order = torch.sort(ids, stable=True).indices
    order = order[torch.sort(descending_key(values[order]), stable=True).indices]
    sample = ids >> (POS_BITS + WINDOW_BITS)
    order = order[torch.sort(sample[order], stable=True).indices]
    order = order[torch.sort(latents[order], stable=True).indices]
    lat, smp = latents[order], sample[order]
    first = torch.ones(len(order), dtype=torch.bool)
    first[1:] = (lat[1:] != lat[:-1]) | (smp[1:] != smp[:-1])
    return order[first]


def descending_key(values: torch.Tensor) -> torch.Tensor:
    """A key sorting non-negative float32 values from the largest (their bit patterns are
    ordered like the values)."""
    return (_U32 - 1) - values.float().contiguous().view(torch.int32).long()


def histogram_edges(bins: int, low: float, high: float) -> np.ndarray:
    """``bins + 1`` log-spaced edges from ``low`` to ``high``."""
    return np.geomspace(low, high, bins + 1)


@dataclass
class LatentState:
    """The state of one token stream (see the module docstring)."""

    n_latents: int
    top_n: int
    per_bin: int
    edges: torch.Tensor
    seed: int = 0
    window: int = 1
    """Tokens of an entry's context window (2 x context + 1; an image's tokens)."""
    distinct: bool = False
    """Top-N over distinct samples: one entry per (latent, sample), its largest."""

    def __post_init__(self):
        n, bins = self.n_latents, len(self.edges) - 1
        self.bins = bins
        self.tokens = 0
        self.counts = torch.zeros(n * bins, dtype=torch.int64)
        self.sums = torch.zeros(n * bins, dtype=torch.float64)
        self.maxima = torch.zeros(n, dtype=torch.float32)
        self.top = _entries(self.window)
        self.samples = _entries(self.window, "cell", "prio")
        self.out_of_order = 0  # chunks not in token order (scan.Chunk.in_order): windows unsure

    def bin_of(self, values: torch.Tensor) -> torch.Tensor:
        inner = self.edges[1:-1].to(values.device, torch.float32)
        return torch.bucketize(values.float(), inner, right=True)

    def update(
        self, values: torch.Tensor, indices: torch.Tensor, ids: torch.Tensor, contexts=None
    ) -> None:
        """Add a batch's code: ``values, indices [B, k]`` and the tokens' ``ids [B]``.
        ``contexts(rows, latents)`` gives the context windows ``[n, window]`` of the
        entries kept, by their row in the batch (``scan.Chunk.contexts``); without it
        they are zeros."""
        self.tokens += int(ids.numel())
        fired = values > 0
        val = values[fired].float().cpu()
        lat = indices[fired].long().cpu()
        fired = fired.cpu()
        tid = ids.cpu().unsqueeze(1).expand_as(fired)[fired]
        row = torch.arange(len(ids)).unsqueeze(1).expand_as(fired)[fired]
        cell = lat * self.bins + self.bin_of(val)
        self.counts += torch.bincount(cell, minlength=self.counts.numel())
        self.sums.index_add_(0, cell, val.double())
        self.maxima.scatter_reduce_(0, lat, val, "amax")
        self.add_candidates(
            {"latent": lat, "value": val, "id": tid, "row": row},
            {"latent": lat, "value": val, "id": tid, "cell": cell, "row": row},
            contexts,
        )

    def add_candidates(self, top: dict, samples: dict, contexts=None) -> None:
        """Fold candidate entries (another state's, or a batch's) into top-N and samples.
        Candidates that cannot enter (below a full top-N's smallest value, above a full
        cell's largest priority) are dropped before the sorts, so once the state fills up
        a batch costs little more than its encoding. A batch's entries carry ``row`` and
        get their window from ``contexts`` once kept; another state's carry ``ctx``."""
        floor = self._top_floor()
        top = _take(top, torch.nonzero(top["value"] >= floor[top["latent"]]).flatten())
        if top["latent"].numel():
            top = _cat(self.top, self._complete(top))
            if self.distinct:
                top = _take(top, best_per_sample(top["latent"], top["value"], top["id"]))
            order = keep_first(top["latent"], descending_key(top["value"]), top["id"], self.top_n)
            self.top = _with_windows(_take(top, order), contexts)
        samples = {**samples, "prio": priority(samples["id"], samples["latent"], self.seed)}
        ceiling = self._sample_ceiling()
        samples = _take(
            samples, torch.nonzero(samples["prio"] <= ceiling[samples["cell"]]).flatten()
        )
        if samples["latent"].numel():
            samples = _cat(self.samples, self._complete(samples))
            order = keep_first(samples["cell"], samples["prio"], samples["id"], self.per_bin)
            self.samples = _with_windows(_take(samples, order), contexts)

    def _complete(self, entries: dict) -> dict:
        """Candidates with every field of the state's entries: ``row`` -1 (window known)
        and ``ctx`` zeros unless they carry them."""
        n = entries["latent"].numel()
        return {
            "row": torch.full((n,), -1, dtype=torch.int64),
            "ctx": torch.zeros(n, self.window, dtype=torch.float32),
            **entries,
        }

    def _top_floor(self) -> torch.Tensor:
        """Per latent, the value a candidate must reach to enter its top-N (0 until full)."""
        latent, value = self.top["latent"], self.top["value"]
        full = torch.bincount(latent, minlength=self.n_latents) >= self.top_n
        smallest = torch.full((self.n_latents,), float("inf")).scatter_reduce(
            0, latent, value, "amin"
        )
        return torch.where(full, smallest, torch.zeros(()))

    def _sample_ceiling(self) -> torch.Tensor:
        """Per (latent, bin), the priority a candidate must not exceed to enter (any until
        the cell holds ``per_bin`` entries)."""
        cells = self.n_latents * self.bins
        cell, prio = self.samples["cell"], self.samples["prio"]
        full = torch.bincount(cell, minlength=cells) >= self.per_bin
        largest = torch.zeros(cells, dtype=torch.int64).scatter_reduce(0, cell, prio, "amax")
        return torch.where(full, largest, torch.full((), _U32))

    def merge(self, other: LatentState) -> None:
        self.tokens += other.tokens
        self.counts += other.counts
        self.sums += other.sums
        self.maxima = torch.maximum(self.maxima, other.maxima)
        self.out_of_order += other.out_of_order
        self.add_candidates(other.top, {n: t for n, t in other.samples.items() if n != "prio"})


def _entries(window: int, *names: str) -> dict:
    return {
        "latent": torch.zeros(0, dtype=torch.int64),
        "value": torch.zeros(0, dtype=torch.float32),
        "id": torch.zeros(0, dtype=torch.int64),
        "row": torch.zeros(0, dtype=torch.int64),
        "ctx": torch.zeros(0, window, dtype=torch.float32),
        **{name: torch.zeros(0, dtype=torch.int64) for name in names},
    }


def _with_windows(entries: dict, contexts) -> dict:
    """Kept entries, those of the batch given their windows (and ``row`` -1)."""
    new = torch.nonzero(entries["row"] >= 0).flatten()
    if new.numel():
        if contexts is not None:
            entries["ctx"][new] = contexts(entries["row"][new], entries["latent"][new])
        entries["row"][new] = -1
    return entries


def _cat(a: dict, b: dict) -> dict:
    return {name: torch.cat([a[name], b[name]]) for name in b}


def _take(entries: dict, index: torch.Tensor) -> dict:
    return {name: t[index] for name, t in entries.items()}
