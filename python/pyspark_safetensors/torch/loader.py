"""Shuffled training batches from a batch-mode dataset, split across data-parallel ranks
and DataLoader workers, resumable.

The epoch's order is built from blocks of consecutive rows (``block_rows``, fewer for a
dataset too small to give every consumer a block of that size): the list of
all blocks is permuted with ``(seed, epoch)``, dealt round-robin to the consumers (rank x
worker), and each consumer permutes the rows of every ``mix_blocks`` consecutive blocks it
owns. Reads stay mostly sequential (a window touches ``mix_blocks`` contiguous regions);
every sample appears exactly once per epoch, and the order depends only on (seed, epoch,
data-parallel rank and size, worker count), so a run resumes exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..format.dtypes import get_dtype
from ..format.errors import InvalidArgumentError
from .dataset import SafetensorsDataset
from .dtypes import as_torch


@dataclass(frozen=True)
class Consumer:
    rank: int
    world: int
    worker: int
    workers: int

    @property
    def index(self) -> int:
        return self.rank * self.workers + self.worker

    @property
    def count(self) -> int:
        return self.world * self.workers


def data_parallel_rank_and_size(dp_rank: int | None, dp_size: int | None) -> tuple[int, int]:
    """The data-parallel rank and size: given, or from torch.distributed (the whole world).
    With tensor parallelism pass the mesh's "data" coordinates, so the ranks of one model
    group receive the same batches."""
    if dp_rank is not None and dp_size is not None:
        if not 0 <= dp_rank < dp_size:
            raise InvalidArgumentError(f"dp_rank {dp_rank} outside 0..{dp_size - 1}")
        return dp_rank, dp_size
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


#: Columns that identify a token; row-aligned datasets must agree on them where both have them.
ALIGNMENT_COLUMNS = ("sample_id", "token_pos")


class MisalignedDatasetsError(InvalidArgumentError):
    """Datasets read as row-aligned are not: their rows are not the same tokens."""


@dataclass(frozen=True)
class _Schema:
    schema: dict


class AlignedDatasets:
    """Row-aligned datasets read as one: ``parts`` maps a column name of the view to
    ``(dataset, its column)``. Row ``i`` of the view is row ``i`` of every dataset, so a
    ``ShuffledBatches`` over it reads each dataset once per batch at the same indices
    (a transcoder's input and target, a crosscoder's hook points).

    Alignment is checked: the same row count and shard row counts on opening, and equal
    ``sample_id`` / ``token_pos`` (where both datasets have them) on the first and last
    rows of a few shards when opened and on every batch read; a ``MisalignedDatasetsError`` names both
    datasets otherwise.

        pairs = AlignedDatasets({"x": (open_dataset(a), "activation"),
                                 "y": (open_dataset(b), "activation")})
        for batch in ShuffledBatches(pairs, 4096):
            x, y = batch["x"], batch["y"]
    """

    mode = "batch"

    def __init__(self, parts: dict[str, tuple[SafetensorsDataset, str]], *, names=None):
        if not parts:
            raise InvalidArgumentError("AlignedDatasets needs at least one dataset")
        self.parts = dict(parts)
        self.names = dict(names or {k: _uri(ds) for k, (ds, _) in self.parts.items()})
        first_key, (first, _) = next(iter(self.parts.items()))
        for key, (ds, column) in self.parts.items():
            if ds.mode != "batch":
                raise InvalidArgumentError(f"{self.names[key]}: a KV dataset has no row order")
            if column not in ds.columns:
                raise InvalidArgumentError(
                    f"{self.names[key]}: no column {column!r}; it has {ds.columns}"
                )
            if list(ds.counts) != list(first.counts):
                raise MisalignedDatasetsError(
                    f"{self.names[first_key]} and {self.names[key]} are not row-aligned: "
                    f"{len(first)} rows in shards of {_summary(first.counts)} against "
                    f"{len(ds)} rows in shards of {_summary(ds.counts)} (write both hook "
                    "points from the same extraction)"
                )
        self.counts, self.starts = list(first.counts), list(first.starts)
        self.metadata = first.metadata
        self.manifest = _Schema({k: ds.manifest.schema[c] for k, (ds, c) in self.parts.items()})
        self._keys = {
            key: [c for c in ALIGNMENT_COLUMNS if c in ds.columns]
            for key, (ds, _) in self.parts.items()
        }
        self._check_sample()

    @property
    def columns(self) -> list[str]:
        return list(self.parts)

    def __len__(self) -> int:
        return sum(self.counts)

    def read_rows(self, shard: int, column: str, rows: np.ndarray) -> np.ndarray:
        """Rows of view column ``column``; reading the first column also checks the rows'
        alignment columns across the datasets."""
        if column == next(iter(self.parts)):
            self.check_rows(shard, rows)
        ds, name = self.parts[column]
        return ds.read_rows(shard, name, rows)

    def check_rows(self, shard: int, rows: np.ndarray) -> None:
        """Refuse rows whose ``sample_id`` / ``token_pos`` differ between two datasets."""
        keys = list(self.parts)
        base = keys[0]
        for key in keys[1:]:
            for column in [c for c in self._keys[base] if c in self._keys[key]]:
                a = self.parts[base][0].read_rows(shard, column, rows)
                b = self.parts[key][0].read_rows(shard, column, rows)
                if not np.array_equal(a, b):
                    bad = int(np.flatnonzero(np.asarray(a != b).reshape(len(rows), -1).any(1))[0])
                    row = self.starts[shard] + int(rows[bad])
                    raise MisalignedDatasetsError(
                        f"{self.names[base]} and {self.names[key]} are not row-aligned: row "
                        f"{row} has {column} {a[bad].tolist()} in one, {b[bad].tolist()} in "
                        "the other (write both hook points from the same extraction)"
                    )

    def _check_sample(self, per_shard: int = 64, shards: int = 8) -> None:
        """The alignment columns of the first and last rows of up to ``shards`` shards
        spread over the dataset (the first and the last among them); the batches read
        later are checked whole."""
        spread = np.linspace(0, len(self.counts) - 1, min(shards, len(self.counts)))
        for shard in np.unique(spread.round().astype(int)).tolist():
            count = self.counts[shard]
            head = np.arange(min(per_shard, count))
            tail = np.arange(max(count - per_shard, len(head)), count)
            self.check_rows(shard, np.concatenate([head, tail]))


def _uri(ds) -> str:
    location = getattr(ds, "location", None)
    return getattr(location, "uri", None) or repr(ds)


def _summary(counts: list[int]) -> str:
    return str(counts) if len(counts) <= 4 else f"[{counts[0]}, {counts[1]}, ..., {counts[-1]}]"


def read_batch(
    dataset, columns: list[str], indices: np.ndarray, dtype: torch.dtype | None
) -> dict[str, torch.Tensor]:
    """``{column: tensor [len(indices), ...]}`` of the rows at global ``indices`` of a
    batch-mode dataset (or ``AlignedDatasets``), floating tensors converted to ``dtype``
    (None: kept as stored)."""
    shard_of = np.searchsorted(np.asarray(dataset.starts), indices, side="right") - 1
    out = {}
    for column in columns:
        col = dataset.manifest.schema[column]
        pieces = np.empty((len(indices), *col.sample_shape), dtype=get_dtype(col.dtype).numpy)
        for shard in np.unique(shard_of):
            sel = np.flatnonzero(shard_of == shard)
            rows = indices[sel] - dataset.starts[shard]
            pieces[sel] = dataset.read_rows(int(shard), column, rows)
        t = as_torch(pieces, col.dtype)
        if dtype is not None and t.is_floating_point() and t.dtype != dtype:
            t = t.to(dtype)
        out[column] = t
    return out


class ShuffledBatches(torch.utils.data.IterableDataset):
    """Batches ``{column: tensor [B, ...]}`` for one consumer; use inside a DataLoader
    (``batch_size=None``) or iterate directly."""

    def __init__(
        self,
        dataset: SafetensorsDataset,
        batch_size: int,
        *,
        columns: list[str] | None = None,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        block_rows: int = 4096,
        mix_blocks: int = 16,
        dtype: torch.dtype | None = torch.float32,
        dp_rank: int | None = None,
        dp_size: int | None = None,
        num_workers: int = 1,
    ):
        if dataset.mode != "batch":
            raise InvalidArgumentError(
                "shuffled batches need a batch-mode dataset; use ds.get(key) for a KV dataset"
            )
        if batch_size < 1 or block_rows < 1 or mix_blocks < 1:
            raise InvalidArgumentError("batch_size, block_rows and mix_blocks must be positive")
        unknown = [c for c in columns or [] if c not in dataset.columns]
        if unknown:
            raise InvalidArgumentError(
                f"column(s) {unknown} not in the dataset; it has {dataset.columns}"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.columns = columns or dataset.columns
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        self.block_rows, self.mix_blocks, self.dtype = block_rows, mix_blocks, dtype
        self.dp_rank, self.dp_size = data_parallel_rank_and_size(dp_rank, dp_size)
        self.num_workers = max(1, num_workers)
        self.epoch = 0
        self.start_batches: list[int] = [0] * self.num_workers
        self.worker_shift = 0
        """DataLoader worker i plays consumer (i + worker_shift) % num_workers: on resume the
        DataLoader starts its round-robin at worker 0, the interrupted run at another."""

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    # -- the order (integers only: cheap, and identical in every process)

    def _blocks(self, consumers: int) -> np.ndarray:
        """(start, stop) global index pairs of every block, in storage order. Blocks are
        ``block_rows`` long, or shorter where the dataset holds fewer than ``block_rows``
        rows per consumer: one block of 4096 rows would leave a second rank nothing."""
        size = max(1, min(self.block_rows, sum(self.dataset.counts) // consumers))
        pairs = []
        for start, count in zip(self.dataset.starts, self.dataset.counts, strict=True):
            for a in range(0, count, size):
                pairs.append((start + a, start + min(a + size, count)))
        return np.array(pairs, dtype=np.int64).reshape(-1, 2)

    def order(self, consumer: Consumer) -> np.ndarray:
        """Global sample indices this consumer yields this epoch, in order."""
        blocks = self._blocks(consumer.count)
        if self.shuffle:
            blocks = blocks[np.random.default_rng([self.seed, self.epoch]).permutation(len(blocks))]
        mine = blocks[consumer.index :: consumer.count]
        rng = np.random.default_rng(
            [self.seed, self.epoch, consumer.rank, consumer.world, consumer.worker]
        )
        parts = []
        for w in range(0, len(mine), self.mix_blocks):
            window = np.concatenate([np.arange(a, b) for a, b in mine[w : w + self.mix_blocks]])
            parts.append(rng.permutation(window) if self.shuffle else window)
        order = np.concatenate(parts) if parts else np.empty(0, np.int64)
        if self.drop_last:  # every consumer yields the same number of full batches
            smallest = min(
                self._owned(Consumer(r, consumer.world, w, consumer.workers), blocks)
                for r in range(consumer.world)
                for w in range(consumer.workers)
            )
            order = order[: (smallest // self.batch_size) * self.batch_size]
        return order

    def _owned(self, consumer: Consumer, blocks: np.ndarray) -> int:
        mine = blocks[consumer.index :: consumer.count]
        return int((mine[:, 1] - mine[:, 0]).sum())

    def num_batches(self, worker: int = 0) -> int:
        n = len(self.order(Consumer(self.dp_rank, self.dp_size, worker, self.num_workers)))
        return -(-n // self.batch_size)

    # -- reading

    def read_batch(self, indices: np.ndarray) -> dict[str, torch.Tensor]:
        return read_batch(self.dataset, self.columns, indices, self.dtype)

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker = (info.id + self.worker_shift) % self.num_workers if info is not None else 0
        if info is not None and info.num_workers != self.num_workers:
            raise InvalidArgumentError(
                f"ShuffledBatches was built for {self.num_workers} workers, the DataLoader has {info.num_workers}"
            )
        order = self.order(Consumer(self.dp_rank, self.dp_size, worker, self.num_workers))
        for start in range(
            self.start_batches[worker] * self.batch_size, len(order), self.batch_size
        ):
            yield self.read_batch(order[start : start + self.batch_size])


class ActivationLoader:
    """The training loader: a ``ShuffledBatches`` behind a DataLoader with ``num_workers``
    processes (or none), counting what it delivered so that ``state_dict()`` /
    ``load_state_dict()`` resume exactly where a run stopped.

        ds = open_dataset("/data/acts")
        loader = ActivationLoader(ds, batch_size=4096, columns=["activation"], num_workers=2)
        for epoch in range(3):
            loader.set_epoch(epoch)
            for batch in loader:
                train_step(batch["activation"])        # float32 [4096, H]
    """

    def __init__(
        self,
        dataset: SafetensorsDataset,
        batch_size: int,
        *,
        num_workers: int = 0,
        pin_memory: bool = False,
        multiprocessing_context=None,
        **options,
    ):
        self.batches = ShuffledBatches(
            dataset, batch_size, num_workers=max(1, num_workers), **options
        )
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.context = multiprocessing_context
        self.delivered = 0

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.batches.epoch:
            self.batches.epoch, self.delivered = epoch, 0

    def __len__(self) -> int:
        return sum(self.batches.num_batches(w) for w in range(self.batches.num_workers))

    def _starts(self, delivered: int) -> tuple[list[int], int]:
        """Batches each worker already produced when ``delivered`` came out, following the
        DataLoader's round-robin over workers (an exhausted worker is skipped), and the
        worker whose turn is next."""
        left = [self.batches.num_batches(w) for w in range(self.batches.num_workers)]
        taken = [0] * len(left)
        w = 0
        for _ in range(delivered):
            while taken[w] >= left[w]:
                w = (w + 1) % len(left)
            taken[w] += 1
            w = (w + 1) % len(left)
        return taken, w

    def __iter__(self):
        self.batches.start_batches, self.batches.worker_shift = self._starts(self.delivered)
        if self.num_workers == 0:
            source = iter(self.batches)
        else:
            source = iter(
                torch.utils.data.DataLoader(
                    self.batches,
                    batch_size=None,
                    num_workers=self.num_workers,
                    pin_memory=self.pin_memory,
                    multiprocessing_context=self.context,
                    persistent_workers=False,
                )
            )
        for batch in source:
            self.delivered += 1
            if self.pin_memory and self.num_workers == 0:
                batch = {k: v.pin_memory() for k, v in batch.items()}
            yield batch
        self.delivered = 0
        self.batches.epoch += 1

    def state_dict(self) -> dict:
        return {"epoch": self.batches.epoch, "delivered": self.delivered, "seed": self.batches.seed}

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.batches.seed:
            raise InvalidArgumentError(
                f"state was saved with seed {state['seed']}, this loader has seed {self.batches.seed}"
            )
        self.batches.epoch, self.delivered = state["epoch"], state["delivered"]
