"""The synthetic model (``evaluation/synthetic.py``): its configuration in SAELens' JSON
form, its files, the structure its samples must have (hierarchy gating, mutual exclusion,
firing rates), and, where sae-lens installs (``.venv-baselines``), the same model as
SAELens builds from the same configuration and its files loaded by SAELens."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from pyspark_safetensors.evaluation.synthetic import (
    FoldedNormalMagnitude,
    HierarchyConfig,
    LinearMagnitude,
    LowRankCorrelationConfig,
    OrthogonalizationConfig,
    RandomFiring,
    SyntheticModel,
    SyntheticModelConfig,
)
from pyspark_safetensors.format.errors import InvalidArgumentError

HAS_SAELENS = importlib.util.find_spec("sae_lens") is not None


def rich_config(**changes) -> SyntheticModelConfig:
    """Every part of the model: a hierarchy with exclusive children and a range of
    branchings, orthogonalised directions, correlated firings, per-feature magnitudes."""
    return (
        SyntheticModelConfig(
            num_features=300,
            hidden_dim=32,
            hierarchy=HierarchyConfig(
                total_root_nodes=10,
                branching_factor=(2, 5),
                max_depth=2,
                mutually_exclusive_portion=0.5,
                compensate_probabilities=True,
            ),
            orthogonalization=OrthogonalizationConfig(num_steps=3),
            correlation=LowRankCorrelationConfig(rank=4),
            std_firing_magnitudes=FoldedNormalMagnitude(mean=0.1, std=0.05),
            mean_firing_magnitudes=LinearMagnitude(1.0, 2.0),
            seed=7,
        )
        if not changes
        else SyntheticModelConfig(**{**rich_config().__dict__, **changes})
    )


def test_the_configuration_round_trips_through_saelens_json_form():
    config = rich_config()
    d = config.to_dict()
    assert d["firing_probability"]["generator_name"] == "zipfian"
    assert d["mean_firing_magnitudes"] == {"start": 1.0, "end": 2.0, "generator_name": "linear"}
    assert d["hierarchy"]["branching_factor"] == [2, 5]
    assert SyntheticModelConfig.from_dict(d) == config
    other = SyntheticModelConfig(num_features=10, hidden_dim=4, firing_probability=RandomFiring())
    assert SyntheticModelConfig.from_dict(other.to_dict()) == other
    with pytest.raises(InvalidArgumentError, match="generator_name"):
        SyntheticModelConfig.from_dict({**d, "firing_probability": {"generator_name": "nope"}})


def test_the_model_is_one_per_configuration_and_its_files_load_back(tmp_path):
    a, b = SyntheticModel.build(rich_config()), SyntheticModel.build(rich_config())
    assert torch.equal(a.feature_vectors, b.feature_vectors)
    assert torch.allclose(a.feature_vectors.norm(dim=1), torch.ones(300), atol=1e-5)
    other = SyntheticModel.build(rich_config(seed=8))
    assert not torch.equal(a.feature_vectors, other.feature_vectors)
    loaded = SyntheticModel.load(a.save(tmp_path / "model"))
    for name in ("feature_vectors", "bias", "firing_probabilities", "mean", "std"):
        assert torch.equal(getattr(loaded, name), getattr(a, name)), name
    assert torch.equal(loaded.correlation[0], a.correlation[0])
    assert [r.to_dict() for r in loaded.roots] == [r.to_dict() for r in a.roots]
    assert np.array_equal(loaded.parent_of, a.parent_of)
    with pytest.raises(InvalidArgumentError, match="not a synthetic model"):
        SyntheticModel.load(tmp_path)


def test_samples_keep_the_hierarchy_and_the_firing_rates():
    model = SyntheticModel.build(rich_config(correlation=None))
    acts = model.sample_features(10_000, torch.Generator().manual_seed(0))
    fires = acts > 0
    children = np.flatnonzero(model.parent_of >= 0)
    # a child fires only with its parent
    parent_fires = fires[:, torch.from_numpy(model.parent_of[children])]
    assert not bool((fires[:, children] & ~parent_fires).any())
    # an exclusive parent's children fire one at a time
    exclusive = [(r, c) for lv in model.levels for r, c in lv.groups]
    assert exclusive
    for _, kids in exclusive:
        assert int(fires[:, kids].sum(1).max()) <= 1
    # the roots (no hierarchy above them) fire at their probabilities
    roots = torch.tensor([r.feature for r in model.roots])
    rate = fires[:, roots].float().mean(0)
    assert torch.allclose(rate, model.firing_probabilities[roots], atol=0.016)
    # magnitudes: mean_i + std_i * N(0, 1), relu'd, and nothing negative anywhere
    assert float(acts.min()) >= 0
    assert float(acts[:, 0][fires[:, 0]].mean()) == pytest.approx(float(model.mean[0]), abs=0.01)


def test_correlated_firings_keep_each_marginal_rate():
    model = SyntheticModel.build(SyntheticModelConfig(
        num_features=64, hidden_dim=16, correlation=LowRankCorrelationConfig(rank=4,
                                                                            correlation_scale=0.3)))  # fmt: skip
    fires = model.sample_features(40_000, torch.Generator().manual_seed(1)) > 0
    assert torch.allclose(fires.float().mean(0), model.firing_probabilities, atol=0.01)
    # and they are correlated: the firing pattern's covariance is not diagonal
    f = fires.float() - fires.float().mean(0)
    corr = torch.corrcoef(f.T)
    off = corr[~torch.eye(64, dtype=torch.bool)]
    assert float(off.abs().max()) > 0.1


@pytest.mark.skipif(not HAS_SAELENS, reason="sae-lens is not installed (.venv-baselines)")
def test_saelens_builds_the_same_model_and_loads_our_files(tmp_path):
    import sae_lens.synthetic as sl

    config = rich_config()
    ours = SyntheticModel.build(config)
    theirs = sl.SyntheticModel(sl.SyntheticModelConfig.from_dict(config.to_dict()))
    assert torch.equal(theirs.feature_dict.feature_vectors, ours.feature_vectors)
    assert torch.equal(theirs.feature_dict.bias, ours.bias)
    gen = theirs.activation_generator
    assert torch.equal(gen.firing_probabilities, ours.firing_probabilities)
    assert torch.equal(gen.mean_firing_magnitudes, ours.mean)
    assert torch.equal(gen.std_firing_magnitudes, ours.std)
    assert torch.equal(theirs.correlation_matrix.correlation_factor, ours.correlation[0])
    assert theirs.hierarchy.to_dict() == {"roots": [r.to_dict() for r in ours.roots]}
    loaded = sl.SyntheticModel.load_from_disk(ours.save(tmp_path / "model"))
    assert torch.equal(loaded.feature_dict.feature_vectors, ours.feature_vectors)
    # and a model SAELens saved reads here as the same one
    theirs.save(tmp_path / "theirs")
    back = SyntheticModel.load(tmp_path / "theirs")
    assert torch.equal(back.feature_vectors, ours.feature_vectors)
    assert np.array_equal(back.parent_of, ours.parent_of)


def _gated_model(exclusive: float, rescale: bool) -> SyntheticModel:
    return SyntheticModel.build(SyntheticModelConfig(
        num_features=60, hidden_dim=8, mean_firing_magnitudes=LinearMagnitude(0.5, 2.0),
        hierarchy=HierarchyConfig(total_root_nodes=3, branching_factor=3, max_depth=2,
                                  mutually_exclusive_portion=exclusive,
                                  scale_children_by_parent=rescale)))  # fmt: skip


def test_children_scaled_by_their_parent():
    """With scale_children_by_parent a child is multiplied by parent / mean_parent (the
    parent's value after its own level), and 0 where the parent is silent."""
    model = _gated_model(0.0, True)
    acts = torch.rand(500, 60, generator=torch.Generator().manual_seed(4))
    acts[acts < 0.5] = 0
    out = model._apply_hierarchy(acts.clone(), torch.Generator())
    for lv in model.levels:
        for f, p in zip(lv.features.tolist(), lv.parents.tolist(), strict=True):
            want = acts[:, f] * out[:, p] / model.mean[p]
            assert torch.allclose(out[:, f], want), (f, p)


@pytest.mark.skipif(not HAS_SAELENS, reason="sae-lens is not installed (.venv-baselines)")
@pytest.mark.parametrize("rescale", [False, True])
def test_the_hierarchy_applies_as_saelens_applies_it(rescale):
    """The same activations through SAELens' modifier and ours: equal without exclusive
    groups (whose winner is a random draw); with them, the roots' groups keep one child in
    the same rows (deeper groups hang on which child won above)."""
    import sae_lens.synthetic as sl

    acts = torch.rand(500, 60, generator=torch.Generator().manual_seed(4))
    acts[acts < 0.6] = 0
    for exclusive in (0.0, 1.0):
        model = _gated_model(exclusive, rescale)
        theirs = sl.SyntheticModel(sl.SyntheticModelConfig.from_dict(model.config.to_dict()))
        got = model._apply_hierarchy(acts.clone(), torch.Generator().manual_seed(0)).relu()
        gen = theirs.activation_generator
        want = gen.modify_activations(acts.clone(), gen).relu()
        if exclusive == 0.0:
            assert torch.equal(got, want)
            continue
        # the roots' groups (whose parents no draw silences): the same rows keep one child
        for _, kids in model.levels[0].groups:
            assert torch.equal((got[:, kids] > 0).sum(1), (want[:, kids] > 0).sum(1))
            assert int((got[:, kids] > 0).sum(1).max()) == 1
