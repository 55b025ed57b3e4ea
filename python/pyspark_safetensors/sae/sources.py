"""Where the trainer's activation rows come from: the one dispatch over the sources it
reads, each served to the same shuffled, rank-split, resumable loader.

- our batch-mode dataset (a directory holding ``dataset_manifest.json``, its manifest, or
  any URI ``open_dataset`` reads);
- a saev dump, seen through ``saev_patches`` x ``saev_layer`` (``docs/interop.md``);
- a Zarr store or Zarr sharded run is refused, naming what to give instead (its
  arrays are ``[seq_len, H]`` per sample and layer, not token rows).

A run trains on pairs ``(x, y)`` (``TrainingSource``): an SAE's ``y`` is its ``x``; a
transcoder's ``x`` and ``y`` come from two row-aligned datasets read at the same indices
(``AlignedDatasets``); a crosscoder's ``x = y`` is its hook points' rows concatenated;
a cross-layer transcoder's ``x`` is its L layers' MLP inputs concatenated and ``y`` their
L outputs, 2L row-aligned datasets read as one.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..dataset.layout import MANIFEST
from ..format.errors import InvalidArgumentError
from ..torch import ShuffledBatches, open_dataset
from ..torch.loader import AlignedDatasets
from .config import TRANSCODERS

#: The view's column names of a transcoder's input and target.
INPUT, TARGET = "input", "target"


def open_activation_source(
    path: str | os.PathLike, *, saev_patches: str = "image", saev_layer: str = "all"
):
    """The dataset of training rows at ``path`` (a ``TorchDataset`` or a saev view with the
    same interface: ``columns``, ``manifest``, ``metadata``, ``len``)."""
    text = os.fspath(path)
    local = Path(text)
    if "://" in text or not local.is_dir() or (local / MANIFEST).is_file():
        return open_dataset(text)
    from ..interop import detect_source  # refuses a directory that is no known source

    source = detect_source(local)
    if source == "saev":
        from ..interop.saev import open_saev

        layer = int(saev_layer) if saev_layer.lstrip("-").isdigit() else saev_layer
        return open_saev(local, patches=saev_patches, layer=layer)
    raise InvalidArgumentError(
        f"{local}: a {source} store holds per-sample arrays; the trainer reads token-level "
        "rows: give a batch-mode dataset or a saev dump (docs/interop.md lists the conversions)"
    )


@dataclass(frozen=True)
class TrainingSource:
    """A run's rows: ``dataset`` (what the loader reads, its columns ``columns``) and how
    a batch of it becomes the pair ``(x [B, d_in], y [B, d_out])`` (``pair``)."""

    dataset: object
    """A ``SafetensorsDataset``, a saev view or an ``AlignedDatasets``."""
    inputs: tuple[str, ...]
    """Columns concatenated into ``x`` (one, except for a crosscoder)."""
    target: str | None
    """Column of ``y``; None: ``y`` is ``x`` (the same tensor)."""
    hook_points: tuple[str, ...]
    """The input hook point of each entry of ``inputs`` ("" where unrecorded)."""
    target_hook_point: str = ""
    targets: tuple[str, ...] = ()
    """A cross-layer transcoder's target columns, one per layer (``y`` is their
    concatenation; ``target`` is then None)."""
    target_hook_points: tuple[str, ...] = ()
    """The hook point of each entry of ``targets``."""

    @property
    def columns(self) -> list[str]:
        return [*self.inputs, *([self.target] if self.target else []), *self.targets]

    @property
    def widths(self) -> tuple[int, ...]:
        """Each input column's row width."""
        return tuple(_width(self.dataset, c) for c in self.inputs)

    @property
    def target_widths(self) -> tuple[int, ...]:
        """Each target column's row width (none when ``y`` is ``x``)."""
        targets = self.targets or ((self.target,) if self.target else ())
        return tuple(_width(self.dataset, c) for c in targets)

    @property
    def d_in(self) -> int:
        """The SAE's input width: the inputs' widths summed (a CLT's: one layer's)."""
        return self.widths[0] if self.targets else sum(self.widths)

    @property
    def d_out(self) -> int:
        """The SAE's output width (a CLT's: one layer's)."""
        return self.target_widths[0] if self.target_widths else self.d_in

    @property
    def metadata(self) -> dict:
        return dict(self.dataset.metadata)

    def __len__(self) -> int:
        return len(self.dataset)

    def pair(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)`` of a loader batch."""
        x = _cat([batch[c] for c in self.inputs])
        if self.targets:
            return x, _cat([batch[c] for c in self.targets])
        return x, (batch[self.target] if self.target else x)

    def read_pairs(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)`` of the rows at ``indices`` (sorted global indices)."""
        reader = ShuffledBatches(self.dataset, max(1, len(indices)), columns=self.columns,
                                 shuffle=False, dp_rank=0, dp_size=1)  # fmt: skip
        return self.pair(reader.read_batch(np.asarray(indices)))

    def batches(self, *, tokens: int = 0, batch: int = 4096) -> Iterator[tuple[torch.Tensor, ...]]:
        """``(x, y)`` of the first ``tokens`` rows (0 = all), in storage order, in chunks
        of ``batch`` rows (every rank reads the same rows)."""
        n = min(len(self), tokens) if tokens else len(self)
        reader = ShuffledBatches(self.dataset, batch, columns=self.columns, shuffle=False,
                                 dp_rank=0, dp_size=1)  # fmt: skip
        for start in range(0, n, batch):
            yield self.pair(reader.read_batch(np.arange(start, min(start + batch, n))))


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def _width(ds, column: str) -> int:
    shape = ds.manifest.schema[column].sample_shape
    if len(shape) != 1:
        raise InvalidArgumentError(
            f"column {column!r} has samples of shape {list(shape)}; the SAE needs token-level "
            "rows [d]"
        )
    return shape[0]


def _column(ds, path: str, column: str) -> None:
    if column not in ds.columns:
        raise InvalidArgumentError(f"{path}: no column {column!r}; it has {ds.columns}")


def _hook(ds) -> str:
    return str(ds.metadata.get("hook_point", ""))


def open_source(config, *, held_out: bool = False) -> TrainingSource | None:
    """The training pairs of ``config`` (``held_out``: its held-out pairs, None when it
    has none). Refuses a missing column, rows that are not vectors, misaligned datasets
    (naming both) and crosscoder hook points of different widths."""
    c = config
    view = {"saev_patches": c.saev_patches, "saev_layer": c.saev_layer}
    if c.architecture == "clt":
        return _clt_source(c, held_out)
    if c.architecture == "crosscoder":
        paths = c.val_datasets if held_out else c.datasets
        if not paths:
            if held_out:
                return None
            raise InvalidArgumentError("a crosscoder needs datasets = [one per hook point]")
        opened = [open_dataset(p) for p in paths]
        for path, ds in zip(paths, opened, strict=True):
            _column(ds, path, c.column)
        names = [f"h{i}" for i in range(len(paths))]
        aligned = AlignedDatasets(
            {n: (ds, c.column) for n, ds in zip(names, opened, strict=True)},
            names=dict(zip(names, paths, strict=True)),
        )
        source = TrainingSource(aligned, tuple(names), None, tuple(_hook(ds) for ds in opened))
        widths = source.widths
        if len(set(widths)) != 1:
            raise InvalidArgumentError(
                f"a crosscoder's hook points must have one width; {list(paths)} have {list(widths)}"
            )
        return source
    path = c.val_dataset if held_out else c.dataset
    if not path:
        if held_out:
            return None
        raise InvalidArgumentError("config.dataset is empty: give the activation dataset directory")
    if c.architecture in TRANSCODERS:
        target = c.val_target_dataset if held_out else c.target_dataset
        x_ds, y_ds = open_dataset(path), open_dataset(target)
        _column(x_ds, path, c.column)
        _column(y_ds, target, c.target_column)
        aligned = AlignedDatasets(
            {INPUT: (x_ds, c.column), TARGET: (y_ds, c.target_column)},
            names={INPUT: path, TARGET: target},
        )
        return TrainingSource(aligned, (INPUT,), TARGET, (_hook(x_ds),), _hook(y_ds))
    ds = open_dataset(path) if held_out else open_activation_source(path, **view)
    _column(ds, path, c.column)
    source = TrainingSource(ds, (c.column,), None, (_hook(ds),))
    _ = source.widths  # refuses rows that are not vectors
    return source


def _clt_source(c, held_out: bool) -> TrainingSource | None:
    """A cross-layer transcoder's pairs: L input and L target datasets, row-aligned."""
    inputs, targets = (
        (c.val_datasets, c.val_target_datasets) if held_out else (c.datasets, c.target_datasets)
    )
    if not inputs:
        if held_out:
            return None
        raise InvalidArgumentError(
            "a cross-layer transcoder needs datasets = [MLP input per layer] and "
            "target_datasets = [MLP output per layer]"
        )
    parts, names = {}, {}
    for prefix, paths, column in (("x", inputs, c.column), ("y", targets, c.target_column)):
        for layer, path in enumerate(paths):
            ds = open_dataset(path)
            _column(ds, path, column)
            parts[f"{prefix}{layer}"], names[f"{prefix}{layer}"] = (ds, column), path
    aligned = AlignedDatasets(parts, names=names)
    hooks = {key: _hook(ds) for key, (ds, _) in parts.items()}
    xs, ys = tuple(k for k in parts if k[0] == "x"), tuple(k for k in parts if k[0] == "y")
    source = TrainingSource(aligned, xs, None, tuple(hooks[k] for k in xs), targets=ys,
                            target_hook_points=tuple(hooks[k] for k in ys))  # fmt: skip
    for kind, paths, widths in (("inputs", inputs, source.widths),
                                ("outputs", targets, source.target_widths)):  # fmt: skip
        if len(set(widths)) != 1:
            raise InvalidArgumentError(
                f"a cross-layer transcoder's layers must have one width; the {kind} "
                f"{list(paths)} have {list(widths)}"
            )
    return source


def open_training_source(config) -> TrainingSource:
    """The training pairs of ``config`` (``open_source``)."""
    return open_source(config)
