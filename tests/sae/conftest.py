"""Tiny real activation datasets for the SAE tests: sparse combinations of a random
dictionary plus noise, so a TopK SAE has structure to find."""

import numpy as np
import pytest

from pyspark_safetensors.dataset import write_batch_dataset


def synthetic_activations(n=8192, d=32, features=96, active=4, seed=0, offset=1.0):
    rng = np.random.default_rng(seed)
    dictionary = rng.standard_normal((features, d)).astype(np.float32)
    dictionary /= np.linalg.norm(dictionary, axis=1, keepdims=True)
    codes = np.zeros((n, features), np.float32)
    rows = np.repeat(np.arange(n), active)
    cols = np.argsort(rng.random((n, features)), axis=1)[:, :active].ravel()
    codes[rows, cols] = rng.uniform(0.5, 2.0, n * active)
    noise = 0.01 * rng.standard_normal((n, d)).astype(np.float32)
    return codes @ dictionary + noise + offset


def make_activation_dataset(root, **kwargs):
    x = synthetic_activations(**kwargs)
    write_batch_dataset(
        root,
        {"activation": x, "sample_id": np.arange(len(x), dtype=np.int64)},
        rows_per_shard=2048,
        metadata={"hook_point": "synthetic.layer"},
    )
    return root


@pytest.fixture(scope="module")
def activations(tmp_path_factory, seed):
    return make_activation_dataset(tmp_path_factory.mktemp("acts") / "acts", seed=seed)


@pytest.fixture(scope="module")
def family_data(tmp_path_factory, seed):
    """The SAE families' hook points (``family_data.make_family_data``)."""
    from family_data import make_family_data

    return make_family_data(tmp_path_factory.mktemp("families"), seed=seed)
