"""torch's side of the safetensors dtype table (``format.dtypes``): the one map between
safetensors dtype names and torch dtypes, and numpy <-> torch views of the same bytes
(bfloat16 and the 8-bit floats included, which ``torch.from_numpy`` does not take)."""

from __future__ import annotations

import numpy as np
import torch

from ..format.dtypes import DTYPES, get_dtype
from ..format.errors import InvalidArgumentError

TORCH_DTYPES: dict[str, torch.dtype] = {
    d.name: getattr(torch, d.numpy.name)
    for d in DTYPES.values()
    if d.numpy is not None and hasattr(torch, d.numpy.name)
}
"""torch dtype by safetensors name: every dtype of the table that torch has (the packed
4- and 6-bit floats have no torch dtype)."""

SAFETENSORS_DTYPES: dict[torch.dtype, str] = {t: name for name, t in TORCH_DTYPES.items()}
"""safetensors name by torch dtype."""

_NUMPY_OWN = frozenset(
    name for name in TORCH_DTYPES if DTYPES[name].numpy.type.__module__ == "numpy"
)
"""Dtypes numpy has itself (the others come from ml_dtypes): torch converts these directly."""
_INT_OF_SIZE = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}
"""An integer type both numpy and torch have, by item size: how raw bytes cross over."""
_TORCH_INT_OF_SIZE = {n: TORCH_DTYPES[get_dtype(t).name] for n, t in _INT_OF_SIZE.items()}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype named any way ``format`` accepts."""
    canonical = get_dtype(name).name
    if canonical not in TORCH_DTYPES:
        raise InvalidArgumentError(f"dtype {canonical} has no torch dtype; read it as raw bytes")
    return TORCH_DTYPES[canonical]


def as_torch(array: np.ndarray, dtype: str) -> torch.Tensor:
    """A torch view of a numpy array holding ``dtype``'s bytes (bfloat16 included)."""
    target, stored = TORCH_DTYPES[dtype], get_dtype(dtype).numpy
    if array.dtype == stored and dtype in _NUMPY_OWN:
        return torch.from_numpy(array)
    return torch.from_numpy(array.view(_INT_OF_SIZE[target.itemsize])).view(target)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A tensor's values as numpy on the CPU, sharing memory when it is a contiguous CPU
    tensor; bfloat16 and the 8-bit floats as their ``ml_dtypes`` types."""
    t = t.detach().cpu().contiguous()
    name = SAFETENSORS_DTYPES[t.dtype]
    numpy_dtype = get_dtype(name).numpy
    if name in _NUMPY_OWN:
        return t.numpy()
    return t.view(_TORCH_INT_OF_SIZE[t.element_size()]).numpy().view(numpy_dtype)


__all__ = ["SAFETENSORS_DTYPES", "TORCH_DTYPES", "as_torch", "to_numpy", "torch_dtype"]
