"""The torch dtype table follows the format's table, and numpy <-> torch views keep the
bytes for every dtype both sides have."""

import numpy as np
import pytest
import torch

from pyspark_safetensors.format import DTYPES, WRITABLE
from pyspark_safetensors.torch import TORCH_DTYPES, as_torch, to_numpy, torch_dtype


def test_every_writable_dtype_has_its_torch_dtype_of_the_same_size():
    assert set(WRITABLE) <= set(TORCH_DTYPES)
    for name, t in TORCH_DTYPES.items():
        assert DTYPES[name].numpy.itemsize == t.itemsize, name
    assert TORCH_DTYPES["BF16"] == torch.bfloat16 and TORCH_DTYPES["F8_E4M3"] == torch.float8_e4m3fn
    assert torch_dtype("half") == torch.float16 and torch_dtype("torch.bfloat16") == torch.bfloat16
    with pytest.raises(ValueError, match="F4 has no torch dtype"):
        torch_dtype("F4")


@pytest.mark.parametrize("name", sorted(TORCH_DTYPES))
def test_views_keep_the_bytes(name):
    raw = np.arange(24, dtype=np.uint8)  # 24 bytes: a whole number of elements of any size
    if name == "BOOL":
        raw = raw % 2
    expected = torch.from_numpy(raw.copy()).view(TORCH_DTYPES[name])
    stored = raw.view(DTYPES[name].numpy)
    for array in (stored, raw):  # the dtype's own numpy type, or its raw bytes
        got = as_torch(array, name)
        assert got.dtype == TORCH_DTYPES[name]
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
    back = to_numpy(expected)
    assert back.dtype == DTYPES[name].numpy and back.tobytes() == raw.tobytes()
