"""Datasets for the torch reader tests, built with the format and dataset layers."""

import numpy as np
import pytest

from pyspark_safetensors.dataset import DatasetBuilder
from pyspark_safetensors.format import to_f16


def make_batch_dataset(root, sizes=(1000, 700, 1300), hidden=8):
    """Token-level dataset: activation [n, hidden] F16 whose row i is i/100 + column/1000,
    and sample_id = global index."""
    with DatasetBuilder(root, batch_size=max(sizes), overwrite=True) as build:
        first = 0
        for n in sizes:
            ids = np.arange(first, first + n, dtype=np.int64)
            acts = to_f16((ids[:, None] % 2048) + np.arange(hidden)[None, :] / 1000.0)
            build.add_batch({"activation": acts, "sample_id": ids})
            first += n
    return root


def make_kv_dataset(root, n=20, hidden=4):
    """Sample-level KV dataset: key k{i} -> layer0 [i+1, hidden], layer1 [i+1, hidden]."""
    with DatasetBuilder(root, mode="kv", name_col="key", overwrite=True) as build:
        build.add_kv(
            {
                f"k{i}": {
                    f"layer{layer}": np.full((i + 1, hidden), i * 10 + layer, np.float32)
                    for layer in range(2)
                }
                for i in range(n)
            }
        )
    return root


@pytest.fixture
def batch_dataset(tmp_path):
    return make_batch_dataset(tmp_path / "tokens")


@pytest.fixture
def kv_dataset(tmp_path):
    return make_kv_dataset(tmp_path / "samples")
