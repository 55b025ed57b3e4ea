"""The companion torch reader: map-style access, shuffled, rank- and worker-split
training batches from safetensors datasets, and batches that follow a dataset as it
grows. Imports torch."""

from .dataset import SafetensorsDataset, open_dataset
from .dtypes import TORCH_DTYPES, as_torch, to_numpy, torch_dtype
from .follow import FollowingBatches, FollowTimeoutError
from .loader import ActivationLoader, ShuffledBatches

__all__ = [
    "TORCH_DTYPES",
    "ActivationLoader",
    "FollowTimeoutError",
    "FollowingBatches",
    "SafetensorsDataset",
    "ShuffledBatches",
    "as_torch",
    "open_dataset",
    "to_numpy",
    "torch_dtype",
]
