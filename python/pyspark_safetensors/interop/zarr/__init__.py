"""Zarr activation stores (the Zarr activation-logger layout): one store or a sharded run
read with ``read(i, l)`` touching only that (sample, layer)'s chunks, a writer per store,
runs of W shards with a ``manifest.json``, a merge, and conversions to and from our KV
datasets and saev dumps.

    from pyspark_safetensors.interop.zarr import open_activations
    x = open_activations("acts.zarr").read(0, 1)   # [seq_len, H] float16

The torch loader (``PairDataset``, ``RandomPairs``, ``collate_pairs``) is imported on
first use, so this package does not import torch.
"""

from .convert import dataset_to_zarr, layer_column, saev_to_zarr, verify_store, zarr_to_dataset
from .store import (
    ActivationRun,
    ActivationStore,
    PerformanceWarning,
    ZarrStoreError,
    open_activations,
    token_chunk,
)
from .write import StoreWriter, merge_run, shard_path, write_run_manifest

_LOADER = ("PairDataset", "RandomPairs", "collate_pairs")


def __getattr__(name: str):
    if name in _LOADER:
        from . import loader

        return getattr(loader, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ActivationRun",
    "ActivationStore",
    "PairDataset",
    "PerformanceWarning",
    "RandomPairs",
    "StoreWriter",
    "ZarrStoreError",
    "collate_pairs",
    "dataset_to_zarr",
    "layer_column",
    "merge_run",
    "open_activations",
    "saev_to_zarr",
    "shard_path",
    "token_chunk",
    "verify_store",
    "write_run_manifest",
    "zarr_to_dataset",
]
