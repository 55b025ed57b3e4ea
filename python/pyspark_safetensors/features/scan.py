"""The tokens of an activation dataset read straight from its shards by global row range
(the dataset is ours: Spark schedules the ranges, the bytes do not cross the JVM) and
encoded a chunk at a time. Each chunk is encoded with the ``margin`` rows either side,
so the context window of any of its tokens is at hand while its candidates are chosen
(``Chunk.contexts``): no second pass re-reads and re-encodes the example samples.

A window's tokens are neighbours in the dataset when its rows are in token order with no
gap inside a window, as an extraction writes them (it may drop a window's first token,
never one inside it): each chunk checks its rows, margins included, so that every
adjacent pair of rows is checked by some chunk, and counts itself ``in_order`` or not.
With no margin (``context`` 0) a window is its token alone and any order will do. Spark's
tasks and the single-process loop scan alike.

An image extraction's window is its whole image (``span``: every token, CLS, registers
and patches, in the model's scan order): an entry's window is the latent's activation on
each token of its image (the heat map over the patch grid), the margin ``span - 1`` rows.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from ..torch.loader import AlignedDatasets
from .config import FeaturesError
from .state import POS_BITS, token_ids

ID_COLUMNS = ("sample_id", "window", "token_pos")
CONTEXT_BLOCK = 2048
"""Entries whose windows are gathered at once (``[block, window, m]`` codes)."""


def row_ranges(total: int, parts: int, multiple: int = 1) -> list[tuple[int, int]]:
    """``[start, stop)`` of up to ``parts`` contiguous ranges of about equal size covering
    ``total`` rows (none empty, but the one range of no rows), each starting at a multiple
    of ``multiple``. The features job gives it its chunk size: every chunk it encodes is
    then one the single-process loop encodes too, the same rows in the same matrix, so
    their codes are the same bits whatever the BLAS (a row's GEMM result can depend on the
    rows beside it: MKL's reproducible path's does)."""
    parts = max(1, min(parts, total))
    step = parts * multiple
    starts = {(total * i + step // 2) // step * multiple for i in range(parts)}
    bounds = sorted(b for b in starts if b < total) or [0]
    return list(itertools.pairwise([*bounds, total]))


class RowReader:
    """Global row ranges of a dataset (``torch.SafetensorsDataset``), across its shards:
    activations as float32 and token ids. Local shards are memory-mapped; elsewhere each
    read fetches just its rows (one ranged read per column and shard).

    Given an ``AlignedDatasets`` (a crosscoder's hook points: the same tokens, row for
    row), a row's activations are each dataset's rows concatenated along the features in
    its order, and its token ids the first's; every range read is checked to be the same
    tokens in all of them (``sample_id`` / ``token_pos``: a ``MisalignedDatasetsError``
    naming both datasets otherwise)."""

    def __init__(self, ds, width: int):
        self.aligned = ds if isinstance(ds, AlignedDatasets) else None
        self.parts = list(ds.parts.values()) if self.aligned else [(ds, "activation")]
        self.ds, self.width = self.parts[0][0], width
        self.starts = np.asarray([*ds.starts, len(ds)], np.int64)

    def read(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows ``[start, stop)``: activations ``[n, width]`` float32 and token ids ``[n]``."""
        xs, ids = [], []
        first = int(np.searchsorted(self.starts, start, side="right")) - 1
        for shard in range(max(first, 0), len(self.starts) - 1):
            lo, hi = int(self.starts[shard]), int(self.starts[shard + 1])
            if lo >= stop:
                break
            a, b = max(start, lo) - lo, min(stop, hi) - lo
            if a >= b:
                continue
            if self.aligned is not None:
                self.aligned.check_rows(shard, np.arange(a, b))
            blocks = [
                np.asarray(ds.shard(shard).row_range(column, a, b), np.float32).reshape(b - a, -1)
                for ds, column in self.parts
            ]
            x = blocks[0] if len(blocks) == 1 else np.concatenate(blocks, axis=1)
            if x.shape[1] != self.width:
                raise FeaturesError(
                    f"activation rows have width {x.shape[1]}, the SAE {self.width}"
                )
            xs.append(x)
            f = self.ds.shard(shard)
            ids.append(token_ids(*(self._column(f, c, a, b) for c in ID_COLUMNS)))
        if not xs:
            return np.zeros((0, self.width), np.float32), np.zeros(0, np.int64)
        return np.concatenate(xs), np.concatenate(ids)

    def _column(self, shard, name: str, a: int, b: int) -> np.ndarray:
        """An id column's rows; ``window`` 0 where the dataset has none (an image
        extraction's: one window per image)."""
        if name == "window" and name not in self.ds.columns:
            return np.zeros(b - a, np.int64)
        return np.asarray(shard.row_range(name, a, b)).reshape(-1)


@dataclass
class Chunk:
    """One chunk's code (its own rows: ``values, indices [B, m]``, ``ids [B]``) with the
    code of the ``margin`` rows either side (``around_*``; row 0 of the chunk is row
    ``offset`` there)."""

    values: torch.Tensor
    indices: torch.Tensor
    ids: torch.Tensor
    around_values: torch.Tensor
    around_indices: torch.Tensor
    around_ids: torch.Tensor
    offset: int
    margin: int
    span: int = 0
    """Tokens of an image (its window is all of them, from position 0); 0 for text
    (a window of +-``margin`` tokens around each entry)."""

    @property
    def in_order(self) -> bool:
        """Whether the rows, margins included, are in strictly increasing token order with
        no token missing inside a window (always, with no margin)."""
        ids = self.around_ids
        if not self.margin or ids.numel() < 2:
            return True
        step = ids[1:] - ids[:-1]
        new_window = (ids[1:] >> POS_BITS) != (ids[:-1] >> POS_BITS)
        return bool(((step == 1) | ((step > 0) & new_window)).all())

    def contexts(self, rows: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        """``[n, 2 x margin + 1]``: the activation of ``latents[i]`` on each token from
        ``margin`` before to ``margin`` after the chunk's row ``rows[i]`` in its window
        (0 where the window has no such token, or the latent does not fire); with a
        ``span``, ``[n, span]``: its activation on each token of the row's image, from
        position 0. Valid when the whole dataset is in token order (see the module
        docstring)."""
        around, device = self.around_ids, self.around_indices.device
        width = self.span or 2 * self.margin + 1
        out = torch.zeros(len(rows), width, dtype=torch.float32)
        for block in range(0, len(rows), CONTEXT_BLOCK):  # bounded [rows, window, m] gathers
            center = rows[block : block + CONTEXT_BLOCK].to(around.device) + self.offset
            base = around[center].unsqueeze(1)
            if self.span:  # positions 0..span-1 of the image, relative to the row's
                offsets = torch.arange(self.span) - (base & ((1 << POS_BITS) - 1))
            else:
                offsets = torch.arange(-self.margin, self.margin + 1).unsqueeze(0)
            pos = (base & ((1 << POS_BITS) - 1)) + offsets
            j = center.unsqueeze(1) + offsets
            there = (j >= 0) & (j < len(around)) & (pos >= 0) & (pos < 1 << POS_BITS)
            j = j.clamp(0, max(len(around) - 1, 0))
            there = (there & (around[j] == base + offsets)).to(device)
            j = j.to(device)
            latents_here = latents[block : block + CONTEXT_BLOCK].to(device)[:, None, None]
            hit = (self.around_indices[j] == latents_here) & there.unsqueeze(2)
            out[block : block + CONTEXT_BLOCK] = (self.around_values[j].float() * hit).sum(2).cpu()
        return out


def encoded_chunks(
    reader: RowReader, start: int, stop: int, sae, *, chunk: int, margin: int, device: str,
    span: int = 0,
) -> Iterator[Chunk]:  # fmt: skip
    """Rows ``[start, stop)`` of ``reader``'s dataset in chunks of ``chunk`` rows, each
    encoded by ``sae`` with ``margin`` rows either side (within the dataset); ``span``:
    the tokens of an image (the windows are whole images, the margin ``span - 1``)."""
    if span:
        margin = span - 1
    total = len(reader.ds)
    for lo in range(start, stop, chunk):
        hi = min(lo + chunk, stop)
        a, b = max(lo - margin, 0), min(hi + margin, total)
        x, ids = reader.read(a, b)
        with torch.inference_mode():
            values, indices = sae.encode(torch.from_numpy(x).to(device))
        ids = torch.from_numpy(ids)
        core = slice(lo - a, hi - a)
        yield Chunk(values[core], indices[core], ids[core], values, indices, ids, lo - a, margin,
                    span)  # fmt: skip


def fold(state, chunks, positions: torch.Tensor | None = None) -> None:
    """Fold encoded chunks into a ``LatentState``: statistics, candidates and their
    windows, and the count of chunks out of token order. ``positions``: a bool per
    ``token_pos``, the tokens that enter the state (an image's CLS, or its patches, ...);
    the others still lend their activations to the windows."""
    for c in chunks:
        if positions is None:
            state.update(c.values, c.indices, c.ids, c.contexts)
        else:
            rows = torch.nonzero(positions[c.ids.cpu() & ((1 << POS_BITS) - 1)]).flatten()
            state.update(c.values[rows.to(c.values.device)], c.indices[rows.to(c.values.device)],
                         c.ids[rows.to(c.ids.device)],
                         lambda r, latents, rows=rows, c=c: c.contexts(rows[r], latents))  # fmt: skip
        state.out_of_order += not c.in_order
