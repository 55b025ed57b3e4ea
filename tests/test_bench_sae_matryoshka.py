"""The Matryoshka benchmark's own logic: its hierarchical activations have the structure
its docstring claims, and its per-prefix FVU (the one evaluator applied to SAELens' SAE
too) agrees with the trainer's own ``fvu_prefix_<m>``."""

import numpy as np
import pytest
import torch

from benchmarks import bench_sae_matryoshka as bench
from pyspark_safetensors.sae.architectures import MatryoshkaSAE
from pyspark_safetensors.sae.evaluate import evaluate_sae


def test_children_fire_only_with_their_parent_and_parents_follow_the_power_law():
    codes = bench.hierarchical_codes(np.random.default_rng(0), 8192)
    parents = codes[:, : bench.PARENTS] > 0
    children = (codes[:, bench.PARENTS :] > 0).reshape(-1, bench.PARENTS, bench.CHILDREN)
    assert (parents.sum(1) == bench.ACTIVE_PARENTS).all()
    assert not (children & ~parents[:, :, None]).any()  # never a child without its parent
    rate = children.sum() / (parents.sum() * bench.CHILDREN)
    assert abs(rate - bench.CHILD_P) < 0.01
    freq = parents.mean(0)
    assert freq[:8].mean() > 3 * freq[-64:].mean()  # a few frequent parents, a long tail
    assert (codes >= 0).all() and codes[codes > 0].min() > 0


def test_prefix_fvus_match_the_trainers_prefix_evaluation():
    torch.manual_seed(0)
    sae = MatryoshkaSAE(16, 64, 4, prefixes=(8, 24, 64))
    with torch.no_grad():
        sae.decoder_bias.normal_()
        sae.threshold.fill_(0.3)  # the eval-mode code: latents above the threshold
    x = torch.randn(300, 16, generator=torch.Generator().manual_seed(1)) + 2.0
    batches = [x[:128], x[128:256], x[256:]]
    want = evaluate_sae(sae, batches)
    got = bench.prefix_fvus(sae, batches, (8, 24, 64))
    np.testing.assert_allclose(got, [want[f"fvu_prefix_{m}"] for m in (8, 24, 64)], rtol=1e-6)
    assert got[-1] == pytest.approx(want["fvu"], rel=1e-6)  # the last prefix is the whole
    assert len(set(got)) == 3  # each prefix decodes a different part of the code
