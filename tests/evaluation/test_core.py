"""SAEBench's core figures (``evaluation/core.py``) against the same figures written here
with numpy on whole arrays: streamed in batches or in one, fed by the ground-truth pass or
on their own, they agree; a duplicated dictionary row is seen as one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pyspark_safetensors.evaluation.core import CoreSums, core_metrics, max_cosine_to_others
from pyspark_safetensors.evaluation.groundtruth import evaluate_ground_truth
from pyspark_safetensors.evaluation.synthetic import SyntheticModel, SyntheticModelConfig
from pyspark_safetensors.sae import TopKSAE

pytestmark = pytest.mark.unit

H, N, K, ROWS = 16, 48, 4, 700


def an_sae(seed=0):
    sae = TopKSAE(H, N, K, seed=seed)
    with torch.no_grad():  # a bias, so that the figures see a non-zero b_dec and b_enc
        sae.encoder_bias.copy_(torch.randn(N, generator=torch.Generator().manual_seed(3)) * 0.1)
        sae.decoder_bias.copy_(torch.randn(H, generator=torch.Generator().manual_seed(4)))
    return sae.eval()


def numpy_figures(sae, x: np.ndarray) -> dict:
    out = sae(torch.from_numpy(x))
    x_hat = out.x_hat.detach().double().numpy()
    code = np.zeros((len(x), N))
    np.put_along_axis(code, out.indices.numpy(), out.values.detach().double().numpy(), 1)
    x = x.astype(np.float64)
    n_in, n_out = np.linalg.norm(x, axis=1), np.linalg.norm(x_hat, axis=1)
    density = (code > 0).mean(0)

    def max_cos(w):
        u = w / np.linalg.norm(w, axis=1, keepdims=True)
        sims = u @ u.T
        np.fill_diagonal(sims, -np.inf)
        return sims.max(1)

    enc = sae.encoder_weight.detach().double().numpy()
    dec = sae.decoder_weight.detach().double().numpy()
    return {
        "explained_variance": 1 - ((x - x_hat) ** 2).sum(1).mean() / x.var(0).sum(),
        "mse": ((x - x_hat) ** 2).mean(),
        "cossim": ((x * x_hat).sum(1) / (n_in * n_out)).mean(),
        "l2_norm_in": n_in.mean(),
        "l2_norm_out": n_out.mean(),
        "l2_ratio": (n_out / n_in).mean(),
        "relative_reconstruction_bias": (n_out**2).mean() / (x * x_hat).sum(1).mean(),
        "l0": (code != 0).sum(1).mean(),
        "l1": code.sum(1).mean(),
        "frac_alive": (density > 0).mean(),
        "freq_over_1_percent": (density > 0.01).mean(),
        "freq_over_10_percent": (density > 0.1).mean(),
        "normalized_freq_over_1_percent": density[density > 0.01].sum() / density.sum(),
        "normalized_freq_over_10_percent": density[density > 0.1].sum() / density.sum(),
        "average_max_encoder_cosine_sim": max_cos(enc).mean(),
        "average_max_decoder_cosine_sim": max_cos(dec).mean(),
        "encoder_decoder_cosine_sim": (enc * dec).sum(1)
        / (np.linalg.norm(enc, axis=1) * np.linalg.norm(dec, axis=1)),
        "feature_density": density,
    }


def test_core_figures_equal_numpy_in_one_batch_or_many():
    sae = an_sae()
    x = np.random.default_rng(0).normal(size=(ROWS, H)).astype(np.float32) * 2 + 1
    want = numpy_figures(sae, x)
    whole = core_metrics(sae, [torch.from_numpy(x)])
    streamed = core_metrics(sae, torch.from_numpy(x).split(64))
    for got in (whole, streamed):
        d = got.to_dict()
        for key, value in want.items():
            if key in d:
                assert d[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
        for key in ("encoder_decoder_cosine_sim", "feature_density"):
            np.testing.assert_allclose(got.per_latent[key], want[key], rtol=1e-5, atol=1e-7)
        assert got.samples == ROWS and 0 < d["frac_alive"] <= 1
    assert (
        "per_latent" not in whole.to_dict()
        and "max_decoder_cosine_sim" in whole.to_dict(per_latent=True)["per_latent"]
    )


def test_a_duplicated_row_is_its_twins_closest():
    w = torch.randn(2500, 8, generator=torch.Generator().manual_seed(0))  # over a chunk
    w[2400] = w[7] * 3.0
    got = max_cosine_to_others(w)
    assert got[7] == pytest.approx(1.0) and got[2400] == pytest.approx(1.0)
    u = torch.nn.functional.normalize(w, dim=1)
    sims = u @ u.T
    sims.fill_diagonal_(-2)
    torch.testing.assert_close(got, sims.max(1).values)
    assert max_cosine_to_others(w[:1]).tolist() == [-1.0]


def test_the_ground_truth_pass_feeds_the_same_figures():
    model = SyntheticModel.build(SyntheticModelConfig(num_features=64, hidden_dim=H, seed=2))
    x, acts = model.sample(ROWS, torch.Generator().manual_seed(1))
    idx = torch.where(acts > 0, torch.arange(64).expand_as(acts), -1)
    sae = an_sae(seed=5)
    sums = CoreSums(N)
    gt = evaluate_ground_truth(sae, model.feature_vectors, [(x, idx, acts)], core=sums)
    fed, alone = sums.result(sae).to_dict(), core_metrics(sae, [x]).to_dict()
    assert fed == pytest.approx(alone, rel=1e-9)
    # the ground truth sums its squares per batch in float32
    assert fed["explained_variance"] == pytest.approx(gt.explained_variance, rel=1e-6)
    assert fed["l0"] == pytest.approx(gt.sae_l0)
