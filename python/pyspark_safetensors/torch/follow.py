"""Training batches from a dataset that is still being written: ``FollowingBatches``
re-reads the manifest, consumes the rows of each commit as it lands, waits when it has
consumed everything committed, and stops at a row budget or once the manifest says
``complete`` and every row has been consumed.

It reads only shards a published manifest lists (the commit point of every write), each
checked against its manifest entry before it is opened; a commit that does not extend
the previous one (an overwrite) stops it with ``DatasetReplacedError``.

The order. Rows are dealt round-robin to the data-parallel ranks in storage order (row
``g`` to rank ``g % dp_size``): rank r's j-th row is global row ``j * dp_size + r``, so the
split depends on nothing but the rows committed, and every rank of a run (whenever it
polls) holds the same number of rows of every full round. A rank's rows are cut into
batches of ``batch_size``: batch k is its rows ``[k B, (k + 1) B)``, available once the
committed rows hold that many full rounds. Rows are shuffled within windows: when a rank
needs a batch its current window does not hold, it opens a window over its rows from that
batch to the last full batch committed (at most ``window_rows``), permuted by
``(seed, rank, dp_size, window start)``. So the order shuffles within what is available,
every rank yields the same number of batches, and a run resumes exactly from
``state_dict()`` (the batches delivered and the current window).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace

import numpy as np
import torch

from ..dataset import (
    MANIFEST,
    DatasetLocation,
    DatasetReplacedError,
    Manifest,
    verify_dataset,
)
from ..dataset.manifest import parse_manifest
from ..format.errors import InvalidArgumentError, PysparkSafetensorsError
from .dataset import SafetensorsDataset
from .loader import (
    AlignedDatasets,
    MisalignedDatasetsError,
    data_parallel_rank_and_size,
    read_batch,
)


class FollowTimeoutError(PysparkSafetensorsError, TimeoutError):
    """No new rows were committed to a followed dataset within the follower's timeout."""


def read_committed(location: DatasetLocation) -> tuple[Manifest | None, bool]:
    """The dataset's published manifest (None before its first commit) and whether it is
    ``complete`` (the producer declared that no more appends come)."""
    if not location.has(MANIFEST):
        return None, False
    try:
        raw = location.read_bytes(MANIFEST)
    except (FileNotFoundError, DatasetReplacedError):  # replaced between the two calls
        return None, False
    manifest = parse_manifest(lambda: raw, location.uri, location.display(MANIFEST))
    complete = getattr(manifest, "complete", None)
    if complete is None:  # a Manifest that does not carry the field reads it from the JSON
        complete = bool(json.loads(raw).get("complete", False))
    return manifest, bool(complete)


def _columns(manifest: Manifest) -> dict:
    return {name: (c.dtype, c.sample_shape) for name, c in manifest.schema.items()}


def _same_shard(a, b) -> bool:
    return (a.shard_path, a.samples_count, a.bytes) == (b.shard_path, b.samples_count, b.bytes)


class _Followed:
    """One followed dataset: its latest published manifest, checked to extend the one
    before, with only the new shards verified against the files."""

    def __init__(self, location: DatasetLocation, checksums: bool):
        self.location, self.checksums = location, checksums
        self.dataset: SafetensorsDataset | None = None
        self.complete = False

    def refresh(self) -> None:
        manifest, complete = read_committed(self.location)
        if manifest is None:
            if self.dataset is not None:
                raise DatasetReplacedError(
                    f"dataset {self.location.uri!r}: its manifest vanished while it was followed"
                )
            return
        manifest.refuse_partitioned(self.location.uri, "FollowingBatches")
        old = self.dataset.manifest if self.dataset is not None else None
        if old is not None and manifest.commit_id == old.commit_id:
            self.complete = complete
            return
        kept = len(old.shards) if old is not None else 0
        if old is not None and (
            len(manifest.shards) < kept
            or not all(map(_same_shard, old.shards, manifest.shards[:kept]))
            or _columns(manifest) != _columns(old)
        ):
            raise DatasetReplacedError(
                f"dataset {self.location.uri!r} was overwritten while it was followed (its "
                "new manifest does not extend the one read before); follow it again"
            )
        if manifest.mode != "batch":
            raise InvalidArgumentError(
                f"dataset {self.location.uri!r}: a KV dataset has no row order to follow"
            )
        if len(manifest.shards) > kept:  # only the new shards: the others were checked
            new = replace(manifest, shards=manifest.shards[kept:])
            verify_dataset(self.location, checksums=self.checksums, manifest=new)
        self.dataset = (
            SafetensorsDataset(self.location, manifest)
            if self.dataset is None
            else self.dataset.grown(manifest)
        )
        self.dataset.checksums = self.checksums
        self.complete = complete


@dataclass(frozen=True)
class _View:
    """What the followed datasets hold now: the rows to read and whether they are final."""

    dataset: object
    """A ``SafetensorsDataset`` or an ``AlignedDatasets`` over the common committed rows."""
    rows: int
    complete: bool


def _common_prefix(datasets: list[SafetensorsDataset]) -> int:
    """Shards committed to every one of row-aligned datasets (each shard the same rows)."""
    n = min(len(ds.counts) for ds in datasets)
    for i in range(n):
        if len({ds.counts[i] for ds in datasets}) > 1:
            return i
    return n


class FollowingBatches:
    """Batches ``{column: tensor [B, ...]}`` of a dataset that grows, for one
    data-parallel rank (see the module docstring for the order).

    ``source``: a dataset path, URI or ``DatasetLocation``; or ``{view column: (path,
    column)}`` for row-aligned datasets written together (a transcoder's input and target,
    a crosscoder's hook points), followed as one over the shards every one has committed.
    ``columns``: the columns read (all by default). ``drop_last``: only full batches (the
    rows beyond the last full batch every rank has are left out); otherwise every row is
    read once, and at the end a rank's last batch may be shorter than another's (empty
    when the rows left are fewer than the ranks). ``max_samples``: a budget of rows over
    all ranks (0 = none): each rank stops after ``max_samples // dp_size`` rows.
    ``poll_interval_s``: seconds between manifest reads while waiting; ``timeout_s``:
    raise ``FollowTimeoutError`` after waiting this long with no new row (None: wait
    forever). ``lookahead``: a batch is yielded once the next one is committed or the
    data is final, so ``finished`` is already True as the last batch comes out (a
    trainer's last step then logs and evaluates as the last).

        loader = FollowingBatches("runs/acts", 4096, columns=["activation"], timeout_s=600)
        for batch in loader:                 # until complete and consumed
            train_step(batch["activation"])
    """

    def __init__(
        self,
        source: str | os.PathLike | DatasetLocation | Mapping[str, tuple],
        batch_size: int,
        *,
        columns: list[str] | None = None,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        window_rows: int = 65536,
        dtype: torch.dtype | None = torch.float32,
        dp_rank: int | None = None,
        dp_size: int | None = None,
        max_samples: int = 0,
        poll_interval_s: float = 1.0,
        timeout_s: float | None = 600.0,
        lookahead: bool = False,
        checksums: bool = False,
        storage_options: dict | None = None,
    ):
        if batch_size < 1 or window_rows < 1 or max_samples < 0:
            raise InvalidArgumentError(
                "batch_size and window_rows must be positive, max_samples >= 0"
            )
        if poll_interval_s <= 0 or (timeout_s is not None and timeout_s < 0):
            raise InvalidArgumentError("poll_interval_s must be > 0 and timeout_s >= 0 or None")
        if isinstance(source, Mapping):
            if not source:
                raise InvalidArgumentError("FollowingBatches needs at least one dataset")
            self.parts = {k: (str(p), c) for k, (p, c) in source.items()}
            paths = [p for p, _ in self.parts.values()]
        else:
            self.parts = None
            paths = [source]
        self.followed = [
            _Followed(DatasetLocation.of(p, storage_options=storage_options), checksums)
            for p in paths
        ]
        self.batch_size, self.columns = batch_size, list(columns) if columns else None
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        self.window_rows = max(batch_size, window_rows // batch_size * batch_size)
        self.dtype, self.max_samples = dtype, max_samples
        self.dp_rank, self.dp_size = data_parallel_rank_and_size(dp_rank, dp_size)
        self.poll_interval_s, self.timeout_s = poll_interval_s, timeout_s
        self.lookahead = lookahead
        self.view: _View | None = None
        self._commits: tuple = ()
        self.delivered = 0
        """Batches yielded so far (this rank's batch k is its rows [k B, (k + 1) B))."""
        self.window: tuple[int, int] | None = None
        self._order: np.ndarray | None = None

    # -- what is committed ---------------------------------------------------------------

    def refresh(self) -> _View | None:
        """Read the manifests again; the view of what is committed (None before the first
        commit of every followed dataset)."""
        for f in self.followed:
            f.refresh()
        opened = [f.dataset for f in self.followed]
        if any(ds is None for ds in opened):
            return None
        complete = all(f.complete for f in self.followed)
        commits = tuple(d.manifest.commit_id for d in opened)
        if self.view is not None and commits == self._commits:
            ds = self.view.dataset  # nothing landed: no shard to check again
        elif self.parts is None:
            ds = opened[0]
        else:
            ds = self._aligned(opened, complete)
        self._commits = commits
        self._check_columns(ds)
        self.view = _View(ds, len(ds), complete)
        return self.view

    def _aligned(self, opened: list[SafetensorsDataset], complete: bool) -> AlignedDatasets:
        """The datasets over the shards every one has committed; when all are complete,
        those must be all their shards."""
        shards = _common_prefix(opened)
        if complete and any(len(d.counts) != shards for d in opened):
            names = [p for p, _ in self.parts.values()]
            raise MisalignedDatasetsError(
                f"{names} are complete but not row-aligned: their shards agree on the first "
                f"{shards} only (write them from the same extraction)"
            )
        cut = [d.grown(replace(d.manifest, shards=d.manifest.shards[:shards])) for d in opened]
        if self.view is not None and shards < len(self.view.dataset.counts):
            raise DatasetReplacedError("row-aligned datasets no longer agree on their shards")
        parts = {
            key: (ds, column)
            for (key, (_, column)), ds in zip(self.parts.items(), cut, strict=True)
        }
        names = {key: path for key, (path, _) in self.parts.items()}
        return AlignedDatasets(parts, names=names)

    def _check_columns(self, ds) -> None:
        unknown = [c for c in self.columns or [] if c not in ds.columns]
        if unknown:
            raise InvalidArgumentError(
                f"column(s) {unknown} not in the dataset; it has {ds.columns}"
            )

    def wait_for(self, rows: int = 1) -> _View:
        """Wait until at least ``rows`` rows are committed (or the datasets are complete),
        polling; returns the view. Raises ``FollowTimeoutError`` after ``timeout_s``
        without a new row."""
        return self._wait(lambda view: view.rows >= rows or view.complete)

    def _wait(self, ready) -> _View:
        waited_since, seen = time.monotonic(), -1
        while True:
            view = self.refresh()
            if view is not None and ready(view):
                return view
            rows = view.rows if view is not None else -1
            if rows != seen:
                waited_since, seen = time.monotonic(), rows
            elif self.timeout_s is not None and time.monotonic() - waited_since > self.timeout_s:
                where = ", ".join(f.location.uri for f in self.followed)
                state = f"{rows} rows committed" if rows >= 0 else "no commit yet"
                raise FollowTimeoutError(
                    f"{where}: no new rows for {self.timeout_s:g} s ({state}, "
                    f"{self.delivered} batches read); the writer stopped without marking the "
                    "dataset complete, or raise timeout_s"
                )
            time.sleep(self.poll_interval_s)

    # -- the order (integers only, the same in every process) ----------------------------

    def _rank_rows(self, view: _View) -> tuple[int, int, int, bool]:
        """``(this rank's rows, the fewest and the most any rank has, final)`` usable now:
        full rounds only until the data is final (complete, or the budget reached)."""
        n, dp = view.rows, self.dp_size
        cap = self.max_samples // dp if self.max_samples else None
        full = n // dp
        final = view.complete or (cap is not None and full >= cap)

        def rows_of(rank: int) -> int:
            rows = full + (rank < n % dp if view.complete else 0)
            return min(rows, cap) if cap is not None else rows

        return rows_of(self.dp_rank), rows_of(dp - 1), rows_of(0), final

    def total_batches(self, view: _View | None = None) -> int | None:
        """Batches each rank yields in all, once the data is final (else None)."""
        view = view or self.view
        if view is None:
            return None
        _, fewest, most, final = self._rank_rows(view)
        if not final:
            return None
        b = self.batch_size
        return fewest // b if self.drop_last else -(-most // b)

    def _batch_ready(self, view: _View, batch: int | None = None) -> bool:
        """Whether batch ``batch`` (default: the next, ``delivered``) can be cut, or the
        data is final (it then exists or the end is reached)."""
        _, fewest, _, final = self._rank_rows(view)
        start = (self.delivered if batch is None else batch) * self.batch_size
        if self._in_window(start) and len(self._order) and int(self._order.max()) >= view.rows:
            return False  # a resumed window over rows not committed here yet
        return final or start + self.batch_size <= fewest

    def _in_window(self, start: int) -> bool:
        return self.window is not None and self.window[0] <= start < self.window[1]

    def _open_window(self, view: _View) -> None:
        """A window from batch ``delivered`` to the last batch available (at most
        ``window_rows`` rows), its rows permuted."""
        mine, fewest, _, final = self._rank_rows(view)
        start = self.delivered * self.batch_size
        if final:
            stop = min(mine, self.total_batches(view) * self.batch_size)
        else:
            stop = fewest // self.batch_size * self.batch_size
        stop = max(start, min(stop, start + self.window_rows))
        self._set_window(start, stop)

    def _set_window(self, start: int, stop: int) -> None:
        self.window = (start, stop)
        rows = np.arange(start, stop, dtype=np.int64)
        if self.shuffle:
            rng = np.random.default_rng([self.seed, self.dp_rank, self.dp_size, start])
            rows = rng.permutation(rows)
        self._order = rows * self.dp_size + self.dp_rank  # the rank's rows -> global rows

    def _next_indices(self) -> np.ndarray | None:
        """Global row indices of the next batch (waiting for them); None at the end."""
        view = self.view or self.wait_for(1)
        if not self._batch_ready(view):
            view = self._wait(self._batch_ready)
        total = self.total_batches(view)
        if total is not None and self.delivered >= total:
            return None
        start = self.delivered * self.batch_size
        if not self._in_window(start):
            self._open_window(view)
        a = start - self.window[0]
        return self._order[a : a + self.batch_size]

    # -- reading -------------------------------------------------------------------------

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        """The batches from ``delivered`` on; after a ``FollowTimeoutError`` iterating
        again continues where it stopped."""
        while (indices := self._next_indices()) is not None:
            ds = self.view.dataset
            batch = read_batch(ds, self.columns or ds.columns, np.asarray(indices), self.dtype)
            after = self.delivered + 1
            if self.lookahead and not self._batch_ready(self.view, after):
                self._wait(lambda view, after=after: self._batch_ready(view, after))
            self.delivered = after
            yield batch

    @property
    def finished(self) -> bool:
        """Whether every batch this rank will ever yield has been yielded."""
        total = self.total_batches()
        return total is not None and self.delivered >= total

    # -- resume --------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Where this rank stands: the batches delivered and the current window."""
        return {
            "following": True,
            "delivered": self.delivered,
            "window": list(self.window) if self.window is not None else None,
            "seed": self.seed,
            "dp_size": self.dp_size,
            "batch_size": self.batch_size,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue with exactly the batches that would have come next (the same seed,
        ranks and batch size; the datasets appended to, never overwritten, since)."""
        if not state.get("following"):
            raise InvalidArgumentError(
                "this state was saved by a loader over a finished dataset, not a follower"
            )
        mine = (self.seed, self.dp_size, self.batch_size)
        saved = (state["seed"], state["dp_size"], state["batch_size"])
        if saved != mine:
            raise InvalidArgumentError(
                f"state was saved with (seed, dp_size, batch_size) {saved}, this loader has {mine}"
            )
        self.delivered = state["delivered"]
        if state["window"] is not None:
            self._set_window(*state["window"])
        else:
            self.window, self._order = None, None
