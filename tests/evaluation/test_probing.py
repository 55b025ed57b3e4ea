"""SAEBench's sparse probing (``evaluation/probing.py``) against computations written here
with numpy alone (the class-mean ranking, a Newton solve of scikit-learn's L2 logistic
regression, the accuracy), and on an SAE whose latents are the true features: a feature
it has a latent for is probed near perfectly from that one latent, random labels near
chance."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pyspark_safetensors.evaluation.probing import (
    balanced_task,
    dense_codes,
    factor_probe_tasks,
    fit_logistic,
    mean_pool,
    probe_tasks,
    sparse_probing,
    synthetic_probe_tasks,
    top_k_latents,
)
from pyspark_safetensors.evaluation.synthetic import SyntheticModel, SyntheticModelConfig
from pyspark_safetensors.format.errors import InvalidArgumentError
from pyspark_safetensors.sae import JumpReLUSAE

pytestmark = pytest.mark.unit


def newton_logistic(x: np.ndarray, y: np.ndarray, c: float = 1.0) -> tuple[np.ndarray, float]:
    """``argmin c * sum log(1 + exp(-s (x w + b))) + |w|^2 / 2`` by Newton's method."""
    a = np.hstack([x, np.ones((len(x), 1))])
    s = 2.0 * y - 1
    reg = np.eye(a.shape[1])
    reg[-1, -1] = 0  # the intercept is not penalised
    theta = np.zeros(a.shape[1])
    for _ in range(100):
        p = 1 / (1 + np.exp(s * (a @ theta)))  # sigmoid(-s m)
        grad = -c * a.T @ (s * p) + reg @ theta
        hess = c * a.T @ (a * (p * (1 - p))[:, None]) + reg
        step = np.linalg.solve(hess, grad)
        theta -= step
        if np.abs(step).max() < 1e-13:
            break
    return theta[:-1], theta[-1]


def numpy_probe(train_x, train_y, test_x, test_y, k=None) -> float:
    if k is not None:
        diff = np.abs(train_x[train_y == 1].mean(0) - train_x[train_y == 0].mean(0))
        cols = np.argsort(-diff, kind="stable")[:k]
        train_x, test_x = train_x[:, cols], test_x[:, cols]
    w, b = newton_logistic(train_x, train_y)
    return float(((test_x @ w + b > 0).astype(int) == test_y).mean())


def small_case(seed=0, n=300, d=12):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)) * rng.uniform(0.2, 2, size=d)
    y = (x[:, 3] - 0.7 * x[:, 8] + 0.8 * rng.normal(size=n) > 0).astype(np.int64)
    return x, y


def test_the_regression_is_scikit_learns_objective_minimised():
    x, y = small_case()
    for c in (1.0, 0.05):
        w, b = fit_logistic(torch.from_numpy(x), torch.from_numpy(y), c=c)
        w_ref, b_ref = newton_logistic(x, y, c)
        np.testing.assert_allclose(w.numpy(), w_ref, atol=1e-6)
        assert b == pytest.approx(b_ref, abs=1e-6)


def test_sparse_probes_equal_the_numpy_computation():
    x, y = small_case(1, n=400)
    tx, ty, vx, vy = (torch.from_numpy(a) for a in (x[:300], y[:300], x[300:], y[300:]))
    got = sparse_probing(tx, ty, vx, vy, ks=(1, 2, 5))
    want = {f"top_{k}": numpy_probe(x[:300], y[:300], x[300:], y[300:], k) for k in (1, 2, 5)}
    want["full"] = numpy_probe(x[:300], y[:300], x[300:], y[300:])
    assert got == pytest.approx(want, abs=1e-12)
    diff = np.abs(x[:300][y[:300] == 1].mean(0) - x[:300][y[:300] == 0].mean(0))
    assert top_k_latents(tx, ty, 2).tolist() == np.argsort(-diff)[:2].tolist()


def test_balanced_tasks_and_mean_pooling():
    fires = np.zeros(100, bool)
    fires[[1, 5, 7, 60, 61, 90]] = True
    t = balanced_task("f", fires, np.arange(50), np.arange(50, 100), seed=0)
    assert sorted(t.train_index[t.train_labels == 1].tolist()) == [1, 5, 7]
    assert len(t.train_index) == 6 and len(t.test_index) == 6 and t.test_labels.sum() == 3
    assert set(t.train_index) <= set(range(50)) and set(t.test_index) <= set(range(50, 100))
    assert (fires[t.test_index] == t.test_labels.astype(bool)).all()
    with pytest.raises(InvalidArgumentError, match="no positive"):
        balanced_task("g", np.zeros(100, bool), np.arange(50), np.arange(50, 100), seed=0)
    acts = torch.tensor([[1.0, 2.0], [3.0, 4.0], [10.0, 0.0]])
    pooled = mean_pool(acts, torch.tensor([0, 0, 2]), 3)
    assert pooled.tolist() == [[2.0, 3.0], [0.0, 0.0], [10.0, 0.0]]


def test_a_latent_of_the_feature_probes_it_and_noise_stays_at_chance():
    """F orthonormal features in H dimensions and a JumpReLU SAE whose dictionary is
    theirs: "does feature f fire" is read off latent f alone; labels drawn at random are
    not read off anything."""
    f, h, rows = 16, 32, 4000
    model = SyntheticModel.build(SyntheticModelConfig(num_features=f, hidden_dim=h, bias=0.5))
    q, _ = torch.linalg.qr(torch.randn(h, f, generator=torch.Generator().manual_seed(0)))
    model.feature_vectors = q.T.contiguous()
    sae = JumpReLUSAE(h, f, 4)
    sae.load_full_state({"encoder_weight": model.feature_vectors.clone(),
                         "encoder_bias": torch.zeros(f),
                         "decoder_weight": model.feature_vectors.clone(),
                         "decoder_bias": model.bias.clone(),
                         "threshold": torch.full((f,), 0.5)})  # fmt: skip
    x, acts = model.sample(rows, torch.Generator().manual_seed(1))
    active = (acts > 0).numpy()
    tasks = synthetic_probe_tasks(active, train_rows=3000, n_tasks=4, min_positives=20)
    codes = dense_codes(sae, x)
    got = probe_tasks(codes, tasks, ks=(1,))
    assert len(tasks) == 4 and got["top_1"] > 0.99 and got["full"] > 0.99
    for t in tasks:  # the top latent is the feature's own
        feature = int(t.name.split("_")[1])
        cols = top_k_latents(codes[torch.from_numpy(t.train_index)],
                             torch.from_numpy(t.train_labels), 1)  # fmt: skip
        assert cols.tolist() == [feature]
    noise = np.random.default_rng(2).random(rows) < 0.3
    chance = probe_tasks(codes, [balanced_task("noise", noise, np.arange(3000),
                                               np.arange(3000, rows), 0)], ks=(1, 5))  # fmt: skip
    assert abs(chance["top_1"] - 0.5) < 0.08 and abs(chance["full"] - 0.5) < 0.08


def test_probe_features_are_checked():
    active = np.zeros((200, 5), bool)
    active[::2, 0] = True
    with pytest.raises(InvalidArgumentError, match=r"probe features \[1\]"):
        synthetic_probe_tasks(active, train_rows=100, features=(1,))
    with pytest.raises(InvalidArgumentError, match="must leave test rows"):
        synthetic_probe_tasks(active, train_rows=200)
    assert [t.name for t in synthetic_probe_tasks(active, train_rows=100)] == ["feature_0"]


def test_factor_tasks_one_value_against_the_rest():
    colour = ["red", "blue", "green", "red"] * 25 + [None] * 4  # None: no label
    size = ["small"] * 103 + ["large"]  # one large image: too few to probe
    tasks, skipped = factor_probe_tasks({"colour": colour, "size": size}, train_examples=50,
                                        min_positives=5)  # fmt: skip
    assert [t.name for t in tasks] == ["colour=blue", "colour=green", "colour=red"]
    assert skipped == ["size=large", "size=small"]
    red = tasks[2]
    labels = np.asarray(colour, dtype=object) == "red"
    assert (labels[red.train_index] == red.train_labels.astype(bool)).all()
    assert red.train_labels.sum() * 2 == len(red.train_index)  # balanced
    assert red.train_index.max() < 50 <= red.test_index.min()
    with pytest.raises(InvalidArgumentError, match="must leave test examples"):
        factor_probe_tasks({"colour": colour}, train_examples=len(colour))


def test_image_factors_are_probed_from_pooled_patch_latents():
    """Images whose patches carry their colour on one direction: the SAE latent on that
    direction probes "is it red" from the patches' mean, as do the raw activations; its
    CLS token carries nothing, so a CLS SAE's probe stays near chance."""
    from types import SimpleNamespace

    from pyspark_safetensors.pipeline.vision import factor_probing

    rng = np.random.default_rng(0)
    n, patches, h = 400, 4, 8
    colour = rng.choice(["red", "blue"], n)
    acts = rng.normal(scale=0.3, size=(n, 1 + patches, h)).astype(np.float32)
    acts[:, 1:, 2] += np.where(colour == "red", 1.0, 0.0)[:, None]
    sae = JumpReLUSAE(h, h, 4)
    sae.load_full_state({"encoder_weight": torch.eye(h), "encoder_bias": torch.zeros(h),
                         "decoder_weight": torch.eye(h), "decoder_bias": torch.zeros(h),
                         "threshold": torch.full((h,), 0.5)})  # fmt: skip
    layout = SimpleNamespace(n_cls=1, n_prefix=1, n_tokens=1 + patches)
    got = factor_probing({"hook": acts}, {"patches": ("hook", "image", sae),
                                          "cls": ("hook", "cls", sae)},
                         layout, {"colour": colour.tolist()})  # fmt: skip
    assert got["tasks"] == ["colour=blue", "colour=red"] and got["train_images"] == n // 2
    patch = got["saes"]["patches"]
    assert patch["sae"]["top_1"] > 0.95 and patch["activations"]["top_1"] > 0.95
    assert set(patch["sae"]["tasks"]) == {"colour=blue", "colour=red"}
    assert abs(got["saes"]["cls"]["sae"]["full"] - 0.5) < 0.12
