"""The companion torch reader: map-style access and shuffled, rank- and worker-split
training batches from safetensors datasets. Imports torch."""

from .dataset import SafetensorsDataset, open_dataset
from .dtypes import TORCH_DTYPES, as_torch, to_numpy, torch_dtype
from .loader import ActivationLoader, ShuffledBatches

__all__ = [
    "TORCH_DTYPES",
    "ActivationLoader",
    "SafetensorsDataset",
    "ShuffledBatches",
    "as_torch",
    "open_dataset",
    "to_numpy",
    "torch_dtype",
]
