"""The TopK SAE on one process: the sparse path against its dense twin, constraints,
DimMap rules."""

import pytest
import torch

from pyspark_safetensors.sae import DimMap, TopKSAE, dense_reference
from pyspark_safetensors.sae.architectures.batchtopk import BATCH_TOPK_ROW_CAP
from pyspark_safetensors.sae.model import BatchTopKSAE, geometric_median


def _sae(d=24, n=96, k=6, seed=0):
    sae = TopKSAE(d, n, k, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        sae.encoder_bias.copy_(0.1 * torch.randn(n, generator=gen))
        sae.decoder_bias.copy_(torch.randn(d, generator=gen))
    return sae


def _grads(sae, loss):
    sae.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in sae.named_parameters()}


@pytest.mark.parametrize("k", [1, 6, 96])
def test_sparse_forward_and_gradients_equal_dense(k):
    sae = _sae()
    x = torch.randn(64, 24, generator=torch.Generator().manual_seed(3)) + 1
    out = sae(x, k=k)
    ref = dense_reference(sae, x, k=k)
    torch.testing.assert_close(out.x_hat, ref, rtol=1e-5, atol=1e-5)
    target = torch.randn_like(x)
    sparse = _grads(sae, (out.x_hat - target).pow(2).sum())
    dense = _grads(sae, (dense_reference(sae, x, k=k) - target).pow(2).sum())
    for name in sparse:
        torch.testing.assert_close(sparse[name], dense[name], rtol=1e-4, atol=1e-4, msg=name)


def test_selection_is_the_dense_top_k():
    sae = _sae()
    x = torch.randn(32, 24)
    out = sae(x)
    pre = torch.relu((x - sae.decoder_bias) @ sae.encoder_weight.T + sae.encoder_bias)
    want = pre.topk(sae.k, dim=1)
    got_sorted = out.values.detach().sort(dim=1, descending=True).values
    torch.testing.assert_close(got_sorted, want.values.detach())
    for row in range(32):
        mask = out.values[row] > 0
        assert set(out.indices[row][mask].tolist()) == set(
            want.indices[row][want.values[row] > 0].tolist()
        )


@pytest.mark.parametrize("aux_rows", [None, 6])
def test_aux_latents_come_from_the_dead_set_with_exact_gradients(aux_rows):
    sae = _sae()
    x = torch.randn(16, 24)
    dead = torch.zeros(96, dtype=torch.bool)
    dead[::3] = True
    out = sae(x, dead=dead, k_aux=5, aux_rows=aux_rows)
    rows = aux_rows or 16
    assert out.aux_values.shape == (rows, 5)
    chosen = out.aux_indices[out.aux_values > 0]
    assert chosen.numel() > 0 and dead[chosen].all()

    def dense_codes():  # the dense twin: top-k of every row, top-5 of the dead of the first rows
        pre = torch.relu((x - sae.decoder_bias) @ sae.encoder_weight.T + sae.encoder_bias)
        vals, idx = pre.topk(sae.k, dim=1)
        aux_vals, aux_idx = (pre[:rows] * dead).topk(5, dim=1)
        code = torch.zeros_like(pre).scatter(1, idx, vals)
        return code, torch.zeros_like(pre[:rows]).scatter(1, aux_idx, aux_vals)

    dense_e = dense_codes()[1] @ sae.decoder_weight
    sparse_e = sae.decode_latents(out.aux_values, out.aux_indices)
    torch.testing.assert_close(sparse_e, dense_e, rtol=1e-5, atol=1e-5)
    # the code's and the AuxK code's gradients meet in the encoder's backward
    target = torch.randn(16, 24)
    sparse = _grads(sae, (sae.decode_latents(out.values, out.indices) - target).pow(2).sum()
                    + sparse_e.pow(2).sum())  # fmt: skip
    code, aux = dense_codes()
    dense = _grads(sae, (code @ sae.decoder_weight - target).pow(2).sum()
                   + (aux @ sae.decoder_weight).pow(2).sum())  # fmt: skip
    for name in ("encoder_weight", "encoder_bias", "decoder_weight", "decoder_bias"):
        torch.testing.assert_close(sparse[name], dense[name], rtol=1e-4, atol=1e-4, msg=name)


def test_initialisation_and_decoder_constraints():
    sae = TopKSAE(16, 64, 4, seed=5)
    torch.testing.assert_close(sae.encoder_weight, sae.decoder_weight)
    torch.testing.assert_close(sae.decoder_weight.norm(dim=1), torch.ones(64))
    again = TopKSAE(16, 64, 4, seed=5)
    assert torch.equal(again.decoder_weight, sae.decoder_weight)
    out = sae(torch.randn(8, 16, generator=torch.Generator().manual_seed(0)))
    out.x_hat.pow(2).sum().backward()
    sae.remove_parallel_gradient()
    grad = sae.decoder_weight.grad
    along_rows = (grad * sae.decoder_weight).sum(dim=1)
    # float32 rounding, relative to the gradient's size (1e-5 absolute failed on some inputs)
    assert along_rows.abs().max() < 1e-6 * grad.norm(dim=1).max()
    with torch.no_grad():
        sae.decoder_weight.mul_(3)
    sae.normalize_decoder()
    torch.testing.assert_close(sae.decoder_weight.norm(dim=1), torch.ones(64))


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="k must be"):
        TopKSAE(8, 16, 17)
    with pytest.raises(ValueError, match="k must be"):
        TopKSAE(8, 16, 0)


def test_geometric_median_is_robust_and_optimal():
    gen = torch.Generator().manual_seed(0)
    cluster = torch.randn(200, 5, generator=gen)
    outliers = torch.full((20, 5), 1000.0)
    points = torch.cat([cluster, outliers])
    gm = geometric_median(points, iters=200)
    assert gm.norm() < 1.0 < points.mean(0).norm()
    # the sum of unit vectors towards the points vanishes at the minimiser
    unit = (points - gm) / (points - gm).norm(dim=1, keepdim=True)
    assert unit.sum(0).norm() < 1.0


def test_dimmap_rules():
    with pytest.raises(ValueError, match="two mesh dims"):
        DimMap({"data": 0, "model": 0})
    m = DimMap({"model": -1})
    assert m._dim("model", 3) == 2
    with pytest.raises(ValueError, match="pass ndim"):
        m._dim("model", None)
    with pytest.raises(ValueError, match="outside"):
        DimMap({"model": 2})._dim("model", 2)
    # without a mesh everything is local and whole
    t = torch.arange(6.0)
    assert DimMap({"model": 0}).distribute(t, None) is t
    assert DimMap({"model": 0}).gather(t, None) is t
    assert DimMap({"model": 0}).local_shape((6, 2), None) == (6, 2)


def test_mesh_must_match_the_world(monkeypatch):
    from pyspark_safetensors.sae import make_mesh

    monkeypatch.setenv("WORLD_SIZE", "1")
    assert make_mesh(1, 1) is None
    with pytest.raises(ValueError, match=r"2 x model_parallel_size 2 = 4, but the world has 1"):
        make_mesh(2, 2)


def test_batch_topk_keeps_k_times_batch_latents_and_a_threshold_at_inference():
    sae = BatchTopKSAE(16, 64, 4, seed=2)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(32, 16, generator=gen) * torch.linspace(0.5, 2, 32)[:, None]  # unequal rows
    out = sae(x)
    per_row = (out.values > 0).sum(1)
    assert int(per_row.sum()) == 4 * 32 and per_row.min() < 4 < per_row.max()
    pre = torch.relu((x - sae.decoder_bias) @ sae.encoder_weight.T + sae.encoder_bias)
    cap = BATCH_TOPK_ROW_CAP * 4
    cand, cand_idx = pre.topk(cap, dim=1)  # each row's candidates
    cut = cand.flatten().topk(4 * 32).values.min()
    assert float(sae.last_threshold) == pytest.approx(float(cut))
    kept = torch.zeros_like(pre).scatter(1, out.indices, out.values)
    # the batch's top 4 x 32 of the rows' candidates, exactly
    torch.testing.assert_close(
        kept, torch.zeros_like(pre).scatter(1, cand_idx, cand * (cand >= cut))
    )
    sae.threshold.fill_(float(cut))
    sae.eval()  # inference: the threshold alone decides, row by row (up to the cap)
    single = sae(x[:1])
    assert int((single.values > 0).sum()) == min(int((pre[0] > cut).sum()), cap)
