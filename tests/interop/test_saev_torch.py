"""A saev dump served by the torch loader: map-style access over a view, and the same
shuffled, rank/worker-split, resumable batches as our datasets (each row once an epoch)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pyspark_safetensors.interop.saev import SaevDump, open_saev  # noqa: E402
from pyspark_safetensors.torch import ActivationLoader, ShuffledBatches  # noqa: E402


def _keys(batches):
    """(image, layer, token) of every row delivered, and its activation."""
    keys, acts = [], []
    for b in batches:
        keys += zip(b["image"].tolist(), b["layer"].tolist(), b["token"].tolist(), strict=True)
        acts.append(b["activation"])
    return keys, torch.cat(acts).numpy() if acts else np.empty((0, 3), np.float32)


def _check_epoch(keys, acts, dump, view):
    want = view.coordinates(np.arange(len(view)))
    assert sorted(keys) == sorted(
        zip(want["image"].tolist(), want["layer"].tolist(), want["token"].tolist(), strict=True)
    )  # every row of the view exactly once
    for (img, layer, token), act in zip(keys, acts, strict=True):
        assert np.array_equal(act, dump.vector(img, layer, token))


def test_map_style_rows_follow_the_view(small_dump):
    root, acts = small_dump
    ds = open_saev(root, patches="all", layer=-1)
    assert len(ds) == 7 * 5 and ds.counts == [10, 10, 10, 5]
    assert ds.manifest.schema["activation"].sample_shape == (3,)
    row = ds[17]  # image 3 (shard 1), layer -1, token 2 = patch 1
    assert {k: v.item() for k, v in row.items() if k != "activation"} == {
        "image": 3, "layer": -1, "token": 2, "patch": 1,
    }  # fmt: skip
    assert torch.equal(row["activation"], torch.from_numpy(acts[3, 1, 2]))
    assert ds[0]["patch"].item() == -1  # the CLS token
    with pytest.raises(IndexError):
        ds[35]


def test_shuffled_batches_split_over_ranks_cover_an_epoch_once(small_dump):
    root, _ = small_dump
    ds = open_saev(root.parent, patches="image", layer="all")
    keys, acts = [], []
    for rank in range(2):
        b = ShuffledBatches(ds, 6, dp_rank=rank, dp_size=2, block_rows=5, mix_blocks=2, seed=3)
        k, a = _keys(b)
        keys += k
        acts.append(a)
    assert len(keys) == len(ds) == 7 * 2 * 4
    _check_epoch(keys, np.concatenate(acts), SaevDump(root), ds.view)


def test_loader_with_worker_processes_and_exact_resume(small_dump):
    root, _ = small_dump
    ds = open_saev(root, patches="image", layer=-2)
    loader = ActivationLoader(ds, 4, num_workers=2, block_rows=3, seed=1)
    keys, acts = _keys(loader)
    _check_epoch(keys, acts, SaevDump(root), ds.view)

    first = ActivationLoader(ds, 4, block_rows=3, seed=1)
    it = iter(first)
    head = [next(it) for _ in range(3)]
    resumed = ActivationLoader(ds, 4, block_rows=3, seed=1)
    resumed.load_state_dict(first.state_dict())
    keys2, acts2 = _keys([*head, *resumed])
    whole, _ = _keys(ActivationLoader(ds, 4, block_rows=3, seed=1))
    assert keys2 == whole
    _check_epoch(keys2, acts2, SaevDump(root), ds.view)


@pytest.mark.trained
def test_sae_trainer_trains_from_a_saev_view(tmp_path, saev_real, seed, figure):
    """Spread (``tests/margins.py``, seeds 0-4 on the pinned CPU path, the same at 1 and 2
    threads): the last FVU is 0.139-0.183 of the first (< 0.5, margin +63 %)."""
    from pyspark_safetensors.sae import SAEConfig
    from pyspark_safetensors.sae import train as train_module

    rng = np.random.default_rng(seed)  # 16-dim activations with 4-dim structure, 64 images
    basis = rng.standard_normal((4, 16)).astype(np.float32)
    acts = (rng.standard_normal((64, 1, 9, 4)).astype(np.float32) @ basis).astype(np.float32)
    root = saev_real.write(tmp_path, saev_real.metadata([-2], 8, True, 16, 64, 9 * 20), acts)
    config = SAEConfig(dataset=str(root), saev_layer="-2", n_latents=32, k=4, batch_size=64, tokens=64 * 100,
                       warmup_steps=2, lr=3e-3, out_dir=str(tmp_path / "sae"), log_every=5,
                       checkpoints=1, progress=False, plots=False, seed=seed)  # fmt: skip
    trainer = train_module.Trainer(config)
    assert trainer.config.d == 16 and len(trainer.dataset) == 64 * 8
    trainer.fit()
    fvu = [r["fvu"] for r in trainer.history]
    figure("fvu_ratio", fvu[-1] / fvu[0], below=0.5)
    assert (tmp_path / "sae" / "sae.safetensors").is_file()
