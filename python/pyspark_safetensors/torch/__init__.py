"""The companion torch reader: map-style access and shuffled, rank- and worker-split
training batches from safetensors datasets. Imports torch."""

from .dataset import SafetensorsDataset, as_torch, open_dataset
from .loader import ActivationLoader, ShuffledBatches

__all__ = ["ActivationLoader", "SafetensorsDataset", "ShuffledBatches", "as_torch", "open_dataset"]
