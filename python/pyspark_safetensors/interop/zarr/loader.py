"""The layout's training access pattern in torch: ``b`` random samples per batch, two
random layers of each, every (sample, layer) one ``read``.

    store = open_activations("acts.zarr")
    loader = torch.utils.data.DataLoader(
        PairDataset(store), batch_sampler=RandomPairs(store, samples_per_batch=8),
        collate_fn=collate_pairs, num_workers=2, multiprocessing_context="spawn")
    for batch in loader:
        batch["acts"]      # [16, T, H] float16, padded with zeros past each seq_len
        batch["seq_len"], batch["sample"], batch["layer"]
"""

from __future__ import annotations

import numpy as np
import torch

from ...format.errors import InvalidArgumentError
from .store import ActivationRun, ActivationStore


class PairDataset(torch.utils.data.Dataset):
    """``ds[(i, layer)]`` -> ``{"acts": [seq_len, H] float16, "sample", "layer"}``. The
    store or run pickles without handles, so each worker opens its own, read-only."""

    def __init__(self, store: ActivationStore | ActivationRun):
        self.store = store

    def __len__(self) -> int:
        return len(self.store) * self.store.num_layers

    def __getitem__(self, index) -> dict:
        i, layer = index if isinstance(index, tuple) else divmod(int(index), self.store.num_layers)
        return {"acts": self.store.read(int(i), int(layer), torch=True), "sample": int(i),
                "layer": int(layer)}  # fmt: skip


class RandomPairs(torch.utils.data.Sampler):
    """Batches of ``(i, layer)``: ``samples_per_batch`` distinct random samples, each with
    ``layers_per_sample`` distinct random layers. One epoch visits every sample once
    (the last batch may be smaller); ``seed`` and ``set_epoch`` fix the order."""

    def __init__(
        self,
        store: ActivationStore | ActivationRun,
        *,
        samples_per_batch: int,
        layers_per_sample: int = 2,
        layers: list[int] | None = None,
        seed: int = 0,
    ):
        self.n = len(store)
        self.layers = np.array(layers if layers is not None else range(store.num_layers))
        if not 1 <= layers_per_sample <= len(self.layers):
            raise InvalidArgumentError(
                f"layers_per_sample={layers_per_sample} must be in [1, {len(self.layers)}]"
            )
        if samples_per_batch < 1:
            raise InvalidArgumentError(f"samples_per_batch must be >= 1, got {samples_per_batch}")
        self.b, self.k, self.seed, self.epoch = samples_per_batch, layers_per_sample, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return -(-self.n // self.b)

    def __iter__(self):
        rng = np.random.default_rng([self.seed, self.epoch])
        order = rng.permutation(self.n)
        for start in range(0, self.n, self.b):
            batch = []
            for i in order[start : start + self.b].tolist():
                for layer in rng.choice(self.layers, self.k, replace=False).tolist():
                    batch.append((i, layer))
            yield batch


def collate_pairs(items: list[dict]) -> dict:
    """Pad to the longest sequence of the batch: ``acts`` [B, T, H], ``seq_len``,
    ``sample``, ``layer`` [B]."""
    lengths = torch.tensor([item["acts"].shape[0] for item in items])
    hidden = items[0]["acts"].shape[1]
    acts = torch.zeros(len(items), int(lengths.max()), hidden, dtype=torch.float16)
    for row, item in enumerate(items):
        acts[row, : item["acts"].shape[0]] = item["acts"]
    return {
        "acts": acts,
        "seq_len": lengths,
        "sample": torch.tensor([item["sample"] for item in items]),
        "layer": torch.tensor([item["layer"] for item in items]),
    }
