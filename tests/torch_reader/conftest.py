"""Datasets for the torch reader tests, built with the format and dataset layers."""

import numpy as np
import pytest

from pyspark_safetensors.dataset import (
    ColumnSchema,
    Manifest,
    ShardEntry,
    index_rows,
    shard_crc32c,
    shard_name,
    write_index,
    write_manifest,
)
from pyspark_safetensors.format import to_f16, write_shard


def make_batch_dataset(root, sizes=(1000, 700, 1300), hidden=8):
    """Token-level dataset: activation [n, hidden] F16 whose row i is i/100 + column/1000,
    and sample_id = global index."""
    root.mkdir(parents=True, exist_ok=True)
    entries, first = [], 0
    for s, n in enumerate(sizes):
        ids = np.arange(first, first + n, dtype=np.int64)
        acts = to_f16((ids[:, None] % 2048) + np.arange(hidden)[None, :] / 1000.0)
        name = shard_name(s, 0)
        header = write_shard(root / name, {"activation": acts, "sample_id": ids})
        entries.append(ShardEntry(name, n, header.file_size, first, shard_crc32c(root / name)))
        first += n
    schema = {
        "activation": ColumnSchema("F16", (max(sizes), hidden), (hidden,)),
        "sample_id": ColumnSchema("I64", (max(sizes),), ()),
    }
    write_manifest(root, Manifest(tuple(entries), schema, mode="batch", batch_size=max(sizes)))
    return root


def make_kv_dataset(root, n=20, hidden=4):
    """Sample-level KV dataset: key k{i} -> layer0 [i+1, hidden], layer1 [i+1, hidden]."""
    root.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for i in range(n):
        for layer in range(2):
            tensors[f"k{i}__layer{layer}"] = np.full((i + 1, hidden), i * 10 + layer, np.float32)
    name = shard_name(0, 0)
    header = write_shard(root / name, tensors)
    write_index(root, [index_rows(name, header)])
    schema = {
        f"layer{layer}": ColumnSchema("F32", (-1, hidden), (-1, hidden)) for layer in range(2)
    }
    write_manifest(
        root,
        Manifest(
            (ShardEntry(name, n, header.file_size, 0),),
            schema,
            mode="kv",
            name_col="key",
            kv_separator="__",
            index_file="_tensor_index.parquet",
        ),
    )
    return root


@pytest.fixture
def batch_dataset(tmp_path):
    return make_batch_dataset(tmp_path / "tokens")


@pytest.fixture
def kv_dataset(tmp_path):
    return make_kv_dataset(tmp_path / "samples")
