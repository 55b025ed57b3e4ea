"""Where the trainer's activation rows come from: the one dispatch over the sources it
reads, each served to the same shuffled, rank-split, resumable loader.

- our batch-mode dataset (a directory holding ``dataset_manifest.json``, its manifest, or
  any URI ``open_dataset`` reads);
- a saev dump, seen through ``saev_patches`` x ``saev_layer`` (``docs/interop.md``);
- a Zarr store or Zarr sharded run is refused, naming what to give instead (its
  arrays are ``[seq_len, H]`` per sample and layer, not token rows).
"""

from __future__ import annotations

import os
from pathlib import Path

from ..dataset.layout import MANIFEST
from ..format.errors import InvalidArgumentError
from ..torch import open_dataset


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


def open_training_source(config):
    """``config.dataset`` opened with the config's saev view."""
    return open_activation_source(
        config.dataset, saev_patches=config.saev_patches, saev_layer=config.saev_layer
    )
