"""The companion torch reader: map-style access, exactly-once shuffled epochs across ranks
and workers, determinism, resume, KV lookups, bad inputs."""

import json
import re

import numpy as np
import pytest
import torch

from pyspark_safetensors.dataset import ManifestError
from pyspark_safetensors.torch import ActivationLoader, ShuffledBatches, open_dataset


def ids_of(batches):
    return (
        np.concatenate([b["sample_id"].numpy() for b in batches])
        if batches
        else np.empty(0, np.int64)
    )


def test_map_style_access_and_views(batch_dataset):
    ds = open_dataset(batch_dataset, checksums=True)
    assert len(ds) == 3000 and ds.columns == ["activation", "sample_id"]
    item = ds[1700]
    assert item["sample_id"].item() == 1700 and item["activation"].dtype == torch.float16
    assert item["activation"][0].item() == pytest.approx(1700 % 2048, rel=1e-3)
    item["activation"][0] = -1  # copy-on-write: the file is untouched
    assert open_dataset(batch_dataset)[1700]["activation"][0].item() != -1
    with pytest.raises(IndexError):
        ds[3000]


def run_consumer(ds, rank, world, workers, batch_size=64, context=None, **options):
    loader = ActivationLoader(
        ds,
        batch_size,
        columns=["sample_id", "activation"],
        num_workers=workers,
        dp_rank=rank,
        dp_size=world,
        multiprocessing_context=context,
        **options,
    )
    return list(loader)


def test_every_sample_once_across_2_ranks_x_2_workers(batch_dataset):
    ds = open_dataset(batch_dataset)
    seen = np.concatenate(
        [ids_of(run_consumer(ds, rank, 2, 2, block_rows=100, mix_blocks=3)) for rank in range(2)]
    )
    assert len(seen) == 3000 and sorted(seen.tolist()) == list(range(3000))


def test_batches_are_float32_and_match_the_data(batch_dataset):
    ds = open_dataset(batch_dataset)
    (batch, *_) = run_consumer(ds, 0, 1, 0)
    acts, ids = batch["activation"], batch["sample_id"].numpy()
    assert acts.dtype == torch.float32 and acts.shape == (64, 8)
    expected = (
        torch.tensor((ids[:, None] % 2048) + np.arange(8)[None, :] / 1000.0)
        .to(torch.float16)
        .float()
    )
    assert torch.equal(acts, expected)


def test_determinism_and_epochs(batch_dataset):
    ds = open_dataset(batch_dataset)
    a = ShuffledBatches(ds, 100, seed=3, block_rows=128)
    b = ShuffledBatches(ds, 100, seed=3, block_rows=128)
    first = ids_of(list(a))
    assert np.array_equal(first, ids_of(list(b)))
    b.set_epoch(1)
    second = ids_of(list(b))
    assert not np.array_equal(first, second) and sorted(first) == sorted(second)
    assert not np.array_equal(first, ids_of(list(ShuffledBatches(ds, 100, seed=4, block_rows=128))))


def test_shuffle_quality(batch_dataset):
    ds = open_dataset(batch_dataset)
    rhos = []
    for seed in range(5):
        order = ids_of(list(ShuffledBatches(ds, 100, seed=seed, block_rows=16, mix_blocks=8)))
        rhos.append(
            np.corrcoef(np.arange(len(order)), order)[0, 1]
        )  # Spearman: order is a permutation
    assert np.mean(np.abs(rhos)) < 0.1
    unshuffled = ids_of(list(ShuffledBatches(ds, 100, shuffle=False)))
    assert np.array_equal(unshuffled, np.arange(3000))


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_mid_epoch_continues_exactly(batch_dataset, workers):
    ds = open_dataset(batch_dataset)
    full = [
        b["sample_id"].numpy()
        for b in ActivationLoader(ds, 50, num_workers=workers, seed=7, block_rows=100)
    ]
    loader = ActivationLoader(ds, 50, num_workers=workers, seed=7, block_rows=100)
    head = []
    for b in loader:
        head.append(b["sample_id"].numpy())
        if len(head) == 17:
            break
    state = json.loads(json.dumps(loader.state_dict()))
    resumed = ActivationLoader(ds, 50, num_workers=workers, seed=7, block_rows=100)
    resumed.load_state_dict(state)
    tail = [b["sample_id"].numpy() for b in resumed]
    assert len(head) + len(tail) == len(full)
    for got, want in zip(head + tail, full, strict=True):
        assert np.array_equal(got, want)


def test_spawn_context_dataloader(batch_dataset):
    ds = open_dataset(batch_dataset)
    batches = run_consumer(ds, 0, 1, 2, batch_size=500, context="spawn")
    assert sorted(ids_of(batches).tolist()) == list(range(3000))


def test_drop_last_gives_equal_full_batches(batch_dataset):
    ds = open_dataset(batch_dataset)
    per_rank = [
        run_consumer(ds, r, 2, 0, batch_size=64, drop_last=True, block_rows=100) for r in range(2)
    ]
    assert len(per_rank[0]) == len(per_rank[1]) > 0
    assert all(len(b["sample_id"]) == 64 for batches in per_rank for b in batches)
    seen = np.concatenate([ids_of(b) for b in per_rank])
    assert len(np.unique(seen)) == len(seen)


def test_a_dataset_smaller_than_a_block_per_rank_feeds_every_rank(tmp_path):
    # one shard of 4096 rows, the default 4096-row blocks, two ranks: each gets half
    from pyspark_safetensors.dataset import write_batch_dataset

    write_batch_dataset(tmp_path / "one", {"sample_id": np.arange(4096, dtype=np.int64)})
    ds = open_dataset(tmp_path / "one")
    loaders = [
        ActivationLoader(ds, 256, drop_last=True, dp_rank=r, dp_size=2, num_workers=0)
        for r in range(2)
    ]
    assert [len(loader) for loader in loaders] == [8, 8]
    seen = np.concatenate([ids_of(list(loader)) for loader in loaders])
    assert sorted(seen.tolist()) == list(range(4096))


def test_kv_lookups(kv_dataset):
    ds = open_dataset(kv_dataset)
    assert ds.mode == "kv" and len(ds.keys()) == 20
    layer = ds.get("k5", "layer1")
    assert layer.shape == (6, 4) and torch.all(layer == 51)
    both = ds["k2"]
    assert set(both) == {"layer0", "layer1"} and both["layer0"].shape == (3, 4)
    with pytest.raises(KeyError, match="no key 'nope'"):
        ds.get("nope")
    with pytest.raises(KeyError, match="no column 'layer9'"):
        ds.get("k1", "layer9")
    with pytest.raises(ValueError, match="batch-mode"):
        ShuffledBatches(ds, 4)


def test_bad_inputs_name_the_file(batch_dataset, tmp_path):
    with pytest.raises(ManifestError, match=re.escape("no dataset_manifest.json")):
        open_dataset(tmp_path)
    shards = sorted(batch_dataset.glob("*.safetensors"))
    data = shards[0].read_bytes()
    shards[0].write_bytes(data[:-2] + bytes([data[-2] ^ 1, data[-1]]))  # same size, one bit flipped
    open_dataset(batch_dataset)  # sizes and headers still agree
    with pytest.raises(ManifestError, match=re.escape(f"{shards[0].name}: crc32c mismatch")):
        open_dataset(batch_dataset, checksums=True)
    shards[1].write_bytes(shards[1].read_bytes()[:-8])
    shards[2].unlink()
    with pytest.raises(ManifestError) as info:
        open_dataset(batch_dataset)
    assert f"{shards[1].name}: " in str(
        info.value
    ) and f"{shards[2].name}: listed in the manifest but missing" in str(info.value)
    (batch_dataset / "dataset_manifest.json").write_text("{not json")
    with pytest.raises(ManifestError, match="not valid JSON"):
        open_dataset(batch_dataset)
