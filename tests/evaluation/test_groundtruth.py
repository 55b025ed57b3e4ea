"""The ground-truth metrics (``evaluation/groundtruth.py``) on SAEs built by hand, whose
figures are known without the code under test: an SAE whose dictionary is the true one
(MCC 1, F1 1, absorption 0), the same with its latents permuted, its directions tilted by a
known angle, a parent latent made to go silent where a child fires (absorption equal to the
share counted from the truth); and, where sae-lens installs, every figure SAELens'
``eval_sae_on_synthetic_data`` defines equal to its own on the same SAE and samples."""

from __future__ import annotations

import importlib.util
import itertools
import math

import numpy as np
import pytest
import torch

from pyspark_safetensors.evaluation.groundtruth import evaluate_ground_truth, match_latents
from pyspark_safetensors.evaluation.synthetic import (
    HierarchyConfig,
    SyntheticModel,
    SyntheticModelConfig,
    ZipfianFiring,
)
from pyspark_safetensors.sae import JumpReLUSAE, export_sae, save_sae

HAS_SAELENS = importlib.util.find_spec("sae_lens") is not None
F, H, ROWS = 24, 48, 3000


def orthonormal_model(seed=0) -> SyntheticModel:
    """F orthonormal directions in H > F dimensions (exact recovery is possible), a
    hierarchy of 4 trees with exclusive children, every feature firing often enough to
    fire in the sample, constant magnitude 1."""
    config = SyntheticModelConfig(
        num_features=F,
        hidden_dim=H,
        firing_probability=ZipfianFiring(max_prob=0.5, min_prob=0.05),
        hierarchy=HierarchyConfig(
            total_root_nodes=4, branching_factor=3, max_depth=1, mutually_exclusive_portion=1.0
        ),
        bias=0.5,
        seed=seed,
    )
    model = SyntheticModel.build(config)
    q, _ = torch.linalg.qr(torch.randn(H, F, generator=torch.Generator().manual_seed(seed)))
    model.feature_vectors = q.T.contiguous()
    return model


def batches(model, rows=ROWS, seed=0, batch=1000):
    """``(x, indices, values)`` as a synthetic dataset holds them (indices padded by -1)."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(rows // batch):
        x, acts = model.sample(batch, gen)
        width = int((acts > 0).sum(1).max())
        order = torch.sort((acts <= 0).to(torch.int8), dim=1, stable=True).indices[:, :width]
        values = torch.gather(acts, 1, order)
        yield x, torch.where(values > 0, order, -1), values


def exact_sae(model, perm=None) -> JumpReLUSAE:
    """A JumpReLU SAE whose dictionary is the model's: with orthonormal directions its
    pre-activations are the true activations (0 or 1, up to rounding, which the thresholds
    of 0.5 cut), so it encodes every sample's features exactly."""
    w = model.feature_vectors if perm is None else model.feature_vectors[perm]
    sae = JumpReLUSAE(H, F, 4)
    sae.load_full_state({"encoder_weight": w.clone(), "encoder_bias": torch.zeros(F),
                         "decoder_weight": w.clone(), "decoder_bias": model.bias.clone(),
                         "threshold": torch.full((F,), 0.5)})  # fmt: skip
    return sae.eval()


def test_the_true_dictionary_scores_perfectly_and_so_does_any_permutation_of_it():
    model = orthonormal_model()
    for perm in (None, torch.randperm(F, generator=torch.Generator().manual_seed(3))):
        m = evaluate_ground_truth(exact_sae(model, perm), model.feature_vectors,
                                  batches(model), parent_of=model.parent_of)  # fmt: skip
        assert m.mcc == pytest.approx(1.0, abs=1e-6)
        assert m.uniqueness == 1.0
        assert (m.precision, m.recall, m.f1, m.accuracy) == pytest.approx((1, 1, 1, 1))
        assert m.explained_variance == pytest.approx(1.0, abs=1e-5)
        assert m.shrinkage == pytest.approx(1.0, abs=1e-5)
        assert m.sae_l0 == pytest.approx(m.true_l0)
        assert m.dead_latents == 0
        assert m.absorption == 0.0 and m.absorption_parents == 4
        assert m.samples == ROWS


def test_tilted_directions_give_the_cosine_as_mcc():
    """Each decoder row tilted by the same angle toward a direction no feature has: its
    cosine with its own feature is cos(angle), with every other 0."""
    model = orthonormal_model()
    extra, _ = torch.linalg.qr(torch.randn(H, H, generator=torch.Generator().manual_seed(1)))
    # directions orthogonal to every feature: the complement of the features' span
    basis = torch.cat([model.feature_vectors, extra.T])
    q, _ = torch.linalg.qr(basis.T)
    free = q.T[F : 2 * F]
    angle = 0.3
    tilted = math.cos(angle) * model.feature_vectors + math.sin(angle) * free
    latent_of, best, mcc = match_latents(tilted, model.feature_vectors)
    assert mcc == pytest.approx(math.cos(angle), abs=1e-5)
    assert list(latent_of) == list(range(F)) and list(best) == list(range(F))


def test_mcc_is_the_best_one_to_one_matching():
    """Against every matching of a 6 x 6 problem (a rectangular one too: 4 latents)."""
    gen = torch.Generator().manual_seed(5)
    feats = torch.randn(6, 8, generator=gen)
    for n in (6, 4):
        dec = torch.randn(n, 8, generator=gen)
        cos = (torch.nn.functional.normalize(dec, dim=1)
               @ torch.nn.functional.normalize(feats, dim=1).T).abs()  # fmt: skip
        brute = max(
            float(cos[torch.arange(n), torch.tensor(cols)].mean())
            for cols in itertools.permutations(range(6), n)
        )
        assert match_latents(dec, feats)[2] == pytest.approx(brute, abs=1e-6)


def test_a_parent_latent_silenced_by_its_children_scores_their_share_as_absorption():
    """The first tree's parent latent also reads minus twice its children: where a child
    fires (value 1) it is silent, and the child's latent fires in its place. Its absorption
    is the share of the parent's firings with a child firing, counted from the truth; the
    other parents' is 0, and the parent latent's recall drops by the same share."""
    model = orthonormal_model()
    sae = exact_sae(model)
    parent = model.roots[0].feature
    kids = [c.feature for c in model.roots[0].children]
    with torch.no_grad():
        sae.encoder_weight[parent] -= 2 * model.feature_vectors[kids].sum(0)
    m = evaluate_ground_truth(sae, model.feature_vectors, batches(model), parent_of=model.parent_of)
    truth = torch.cat(
        [
            torch.zeros(len(i), F + 1).scatter_(1, torch.where(i >= 0, i, F), 1.0)
            for _, i, _ in batches(model)
        ]
    )[:, :F]  # padding into a spare column
    on = truth[:, parent] > 0
    share = int((truth[on][:, kids].sum(1) > 0).sum()) / int(on.sum())
    assert 0.2 < share < 1
    assert m.per_parent_absorption[parent] == pytest.approx(share, abs=1e-9)
    others = [v for p, v in m.per_parent_absorption.items() if p != parent]
    assert others == [0.0, 0.0, 0.0]
    assert m.absorption == pytest.approx(share / 4, abs=1e-9)
    assert m.recall == pytest.approx(1 - share / F, abs=1e-6)


def _saelens_parity(tmp_path, sae_file, model):
    """Our figures and SAELens' on the same SAE (exported to its layout) and samples."""
    from sae_lens import SAE
    from sae_lens.synthetic import SyntheticModel as SLModel
    from sae_lens.synthetic import eval_sae_on_synthetic_data

    from pyspark_safetensors.sae import load_sae_model

    ours_sae = load_sae_model(sae_file)
    theirs_sae = SAE.load_from_disk(str(export_sae(sae_file, tmp_path / "saelens", "saelens")))
    sl_model = SLModel.load_from_disk(model.save(tmp_path / "model"))
    acts = torch.cat([model.sample_features(1000, torch.Generator().manual_seed(s))
                      for s in range(3)])  # fmt: skip

    class Replay:  # hands SAELens our samples, in order
        def __init__(self):
            self.at = 0

        def sample(self, n):
            self.at += n
            return acts[self.at - n : self.at]

    theirs = eval_sae_on_synthetic_data(theirs_sae, sl_model.feature_dict, Replay(),
                                        num_samples=len(acts), batch_size=1000)  # fmt: skip
    x = model.hidden(acts)
    ours = evaluate_ground_truth(ours_sae, model.feature_vectors,
                                 ((x[i : i + 1000], *_sparse(acts[i : i + 1000]))
                                  for i in range(0, len(acts), 1000)))  # fmt: skip
    pairs = {"mcc": theirs.mcc, "uniqueness": theirs.uniqueness, "sae_l0": theirs.sae_l0,
             "true_l0": theirs.true_l0, "dead_latents": theirs.dead_latents,
             "shrinkage": theirs.shrinkage, "explained_variance": theirs.explained_variance,
             "precision": theirs.classification.precision, "recall": theirs.classification.recall,
             "f1": theirs.classification.f1_score,
             "accuracy": theirs.classification.accuracy}  # fmt: skip
    for name, value in pairs.items():
        assert getattr(ours, name) == pytest.approx(value, abs=1e-4), name
    return ours


def _sparse(acts):
    width = int((acts > 0).sum(1).max())
    order = torch.sort((acts <= 0).to(torch.int8), dim=1, stable=True).indices[:, :width]
    values = torch.gather(acts, 1, order)
    return torch.where(values > 0, order, -1), values


@pytest.mark.skipif(not HAS_SAELENS, reason="sae-lens is not installed (.venv-baselines)")
@pytest.mark.parametrize("architecture", ["topk", "jumprelu"])
def test_every_figure_saelens_defines_equals_its_own(tmp_path, architecture):
    """A random SAE over a model in superposition (more features than dimensions), so that
    no figure is trivially 0 or 1."""
    config = SyntheticModelConfig(num_features=96, hidden_dim=32,
                                  hierarchy=HierarchyConfig(total_root_nodes=4, branching_factor=4,
                                                            max_depth=1,
                                                            mutually_exclusive_portion=0.5),
                                  seed=2)  # fmt: skip
    model = SyntheticModel.build(config)
    gen = torch.Generator().manual_seed(9)
    dec = model.feature_vectors[torch.randperm(96, generator=gen)[:64]]
    dec = torch.nn.functional.normalize(dec + 0.4 * torch.randn(64, 32, generator=gen), dim=1)
    tensors = {"encoder_weight": dec.clone(), "encoder_bias": -0.2 * torch.rand(64, generator=gen),
               "decoder_weight": dec, "decoder_bias": model.bias.clone()}  # fmt: skip
    meta = {"k": "6"}
    if architecture == "jumprelu":
        tensors["threshold"] = 0.1 + 0.3 * torch.rand(64, generator=gen)
        meta["architecture"] = "jumprelu"
    sae_file = tmp_path / "sae.safetensors"
    save_sae(sae_file, tensors, meta)
    ours = _saelens_parity(tmp_path, sae_file, model)
    assert 0.2 < ours.mcc < 0.99 and 0 < ours.f1 < 0.9


def test_an_sae_of_another_width_is_refused():
    model = orthonormal_model()
    with pytest.raises(ValueError, match="width"):
        evaluate_ground_truth(JumpReLUSAE(H + 1, 8, 2), model.feature_vectors, batches(model))


def test_metrics_are_json_ready():
    model = orthonormal_model()
    m = evaluate_ground_truth(exact_sae(model), model.feature_vectors, batches(model, rows=1000))
    d = m.to_dict()
    assert d["absorption"] is None and d["absorption_parents"] == 0  # no hierarchy given
    assert np.isfinite(d["mcc"])


@pytest.mark.parametrize("seed", [0, 7])
def test_an_sae_seeded_as_the_synthetic_model_does_not_start_at_its_features(seed):
    """The model draws its true directions as ``torch.randn`` on its seed; an SAE's initial
    weights come from a salted generator (``init_generator``), so an SAE given the same
    seed starts away from them (drawn from the bare seed, its decoder rows were the true
    directions: MCC 1.0 before any training)."""
    from pyspark_safetensors.evaluation.groundtruth import cosine_similarities
    from pyspark_safetensors.sae import TopKSAE

    model = SyntheticModel.build(SyntheticModelConfig(num_features=F, hidden_dim=H, seed=seed))
    torch.manual_seed(seed)  # what the model drew its directions from
    assert cosine_similarities(torch.randn(F, H), model.feature_vectors).diagonal().min() > 0.9
    sae = TopKSAE(H, F, 4, seed=seed)
    for weights in (sae.decoder_weight, sae.encoder_weight):
        assert cosine_similarities(weights.detach(), model.feature_vectors).abs().max() < 0.8
