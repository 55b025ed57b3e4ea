"""Remote datasets: the same reads through fsspec (``memory://``) and pyarrow filesystems
(ranged reads, one listing) as through local mmaps."""

import json

import fsspec
import numpy as np
import pyarrow.fs as pafs
import pytest
import torch

from pyspark_safetensors.dataset import DatasetLocation, ManifestError
from pyspark_safetensors.torch import ActivationLoader, ShuffledBatches, open_dataset


def upload(local, url):
    """Copy a local dataset directory into fsspec's memory filesystem."""
    fs = fsspec.filesystem("memory")
    root = url.removeprefix("memory://")
    if fs.exists(root):
        fs.rm(root, recursive=True)
    for path in local.rglob("*"):
        if path.is_file():
            fs.pipe(f"{root}/{path.relative_to(local).as_posix()}", path.read_bytes())
    return fs


def subtree(local):
    """A pyarrow filesystem rooted at the dataset's parent: read like an object store."""
    return pafs.SubTreeFileSystem(str(local.parent), pafs.LocalFileSystem()), local.name


def same_batches(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for k in x:
            assert torch.equal(x[k], y[k])


def test_uri_resolution(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    local = pafs.LocalFileSystem
    for path in ("acts", "file:acts", f"file://{tmp_path}/acts", tmp_path / "acts"):
        loc = DatasetLocation.of(path)
        assert isinstance(loc.fs, local) and loc.root == str(tmp_path / "acts")
    for uri in ("s3://bucket/acts", "s3a://bucket/acts", "s3n://bucket/acts"):
        loc = DatasetLocation.of(uri, storage_options={"endpoint_url": "http://127.0.0.1:1"})
        assert isinstance(loc.fs, pafs.S3FileSystem) and loc.root == "bucket/acts"
    memory = DatasetLocation.of("memory://x/y")
    assert isinstance(memory.fs, pafs.PyFileSystem) and memory.root.endswith("x/y")
    with pytest.raises(ValueError, match="relative name inside the dataset"):
        memory.path("../secret.safetensors")


def test_memory_filesystem_reads_equal_local(batch_dataset):
    upload(batch_dataset, "memory://tokens")
    local, remote = open_dataset(batch_dataset), open_dataset("memory://tokens", checksums=True)
    assert len(remote) == len(local) == 3000 and remote.columns == local.columns
    for i in (0, 999, 1000, 1700, 2999):
        for k, v in local[i].items():
            assert torch.equal(remote[i][k], v)
    np.testing.assert_array_equal(
        remote.shard_view(1, "activation"), local.shard_view(1, "activation")
    )
    rows = np.array([650, 3, 4, 699, 0, 5])
    np.testing.assert_array_equal(
        remote.read_rows(1, "activation", rows), local.read_rows(1, "activation", rows)
    )
    options = dict(batch_size=128, columns=["sample_id", "activation"], block_rows=50, mix_blocks=4)
    same_batches(list(ShuffledBatches(remote, **options)), list(ShuffledBatches(local, **options)))


def test_pyarrow_filesystem_with_workers(batch_dataset):
    fs, name = subtree(batch_dataset)
    remote, local = open_dataset(name, filesystem=fs), open_dataset(batch_dataset)
    assert not isinstance(remote.location.fs, pafs.LocalFileSystem)
    # spawned workers unpickle the filesystem and open their own files
    loader = ActivationLoader(
        remote, 256, columns=["sample_id"], num_workers=2, multiprocessing_context="spawn"
    )
    ids = np.concatenate([b["sample_id"].numpy() for b in loader])
    assert sorted(ids.tolist()) == list(range(3000))
    reference = ActivationLoader(
        local, 256, columns=["sample_id"], num_workers=2, multiprocessing_context="spawn"
    )
    assert ids.tolist() == np.concatenate([b["sample_id"].numpy() for b in reference]).tolist()


def test_kv_lookups_are_ranged_reads(kv_dataset):
    upload(kv_dataset, "memory://samples")
    remote, local = open_dataset("memory://samples"), open_dataset(kv_dataset)
    assert sorted(remote.keys()) == sorted(local.keys())
    for key in ("k0", "k7", "k19"):
        assert torch.equal(remote.get(key, "layer1"), local.get(key, "layer1"))
        got = remote[key]
        assert got.keys() == {"layer0", "layer1"} and got["layer0"].shape == (int(key[1:]) + 1, 4)
    with pytest.raises(KeyError, match="no key 'nope'"):
        remote.get("nope")


def test_remote_bad_inputs_name_the_file(batch_dataset, kv_dataset):
    local = batch_dataset
    fs = upload(local, "memory://bad")
    shard = json.loads((local / "dataset_manifest.json").read_text())["shards"][1]["shard_path"]
    fs.pipe(f"/bad/{shard}", fs.cat(f"/bad/{shard}")[:-10])  # truncated
    with pytest.raises(ManifestError, match=f"{shard}: .* bytes on disk, the manifest says"):
        open_dataset("memory://bad")
    fs.rm(f"/bad/{shard}")
    with pytest.raises(ManifestError, match=f"{shard}: listed in the manifest but missing"):
        open_dataset("memory://bad")
    with pytest.raises(ManifestError, match=r"no dataset_manifest\.json"):
        open_dataset("memory://nowhere")
    doc = json.loads((local / "dataset_manifest.json").read_text())
    doc["shards"][0]["shard_path"] = "../outside.safetensors"
    fs.pipe("/bad/dataset_manifest.json", json.dumps(doc).encode())
    with pytest.raises(ValueError, match="must be a relative name inside the dataset"):
        open_dataset("memory://bad")
    # a corrupted byte inside a shard of the right size: the checksum catches it
    fs = upload(kv_dataset, "memory://kv")
    kv_doc = json.loads((kv_dataset / "dataset_manifest.json").read_text())
    kv_doc["shards"][0]["crc32c"] = "00000000"
    fs.pipe("/kv/dataset_manifest.json", json.dumps(kv_doc).encode())
    with pytest.raises(ManifestError, match="crc32c mismatch"):
        open_dataset("memory://kv", checksums=True)
