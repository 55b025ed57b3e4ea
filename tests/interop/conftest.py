"""saev dumps written by hand the way saev's own writer lays them out (independent of our
writer): ``metadata.json`` with ``indent=4`` in the hash directory, every shard a
``np.memmap`` of the full shard shape (the last one zero-padded), or cut to its images
as protocol §5 allows."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest


def seed_metadata(layers, n_patches, cls_token, d, n_imgs, budget, /, **changes) -> dict:
    """The seed's ten keys in saev's order."""
    doc = {
        "vit_family": "clip",
        "vit_ckpt": "ViT-B-16/openai",
        "layers": list(layers),
        "n_patches_per_img": n_patches,
        "cls_token": cls_token,
        "d_vit": d,
        "seed": 42,
        "n_imgs": n_imgs,
        "max_patches_per_shard": budget,
        "data": "ImageFolder(root='imgs')",
    }
    doc.update(changes)
    return {k: v for k, v in doc.items() if v is not None}


def write_saev_dump(
    dump_to: Path, doc: dict, acts: np.ndarray, *, pad=True, compact=False, extra_shard=False
) -> Path:
    """Write ``acts [n_imgs, L, T, D]`` as saev does; returns the hash directory."""
    text = json.dumps(doc, sort_keys=True, separators=(",", ":") if compact else None)
    root = Path(dump_to) / hashlib.sha256(text.encode()).hexdigest()
    root.mkdir(parents=True)
    (root / "metadata.json").write_text(json.dumps(doc, indent=4))
    budget = doc.get("max_patches_per_shard", doc.get("n_patches_per_shard"))
    per_shard = budget // (acts.shape[1] * acts.shape[2])
    starts = list(range(0, len(acts), per_shard))
    if extra_shard and len(acts) % per_shard == 0:
        starts.append(len(acts))
    for s, a in enumerate(starts):
        part = acts[a : a + per_shard]
        shape = (per_shard if pad else len(part), *acts.shape[1:])
        mm = np.memmap(root / f"acts{s:06}.bin", mode="w+", dtype=np.float32, shape=shape)
        mm[: len(part)] = part
        mm.flush()
        del mm
    return root


@pytest.fixture
def small_dump(tmp_path):
    """A 7-image, 2-layer dump with CLS (T = 5, d = 3, 2 images per shard, last padded),
    and its activations."""
    acts = np.random.default_rng(0).standard_normal((7, 2, 5, 3)).astype(np.float32)
    doc = seed_metadata([-2, -1], 4, True, 3, 7, 25)
    return write_saev_dump(tmp_path / "shards", doc, acts), acts


@pytest.fixture(scope="session")
def saev_real():
    """The helpers above, for tests (session scope: usable under Hypothesis)."""
    return SimpleNamespace(metadata=seed_metadata, write=write_saev_dump)
