"""The replacement model on the tiny toy Llama: its logits against a hand computation with
hooks, the evaluation's figures against direct computations, per-layer transcoders as the
CLT's l -> l case, the whole-model LUT against the CLT within float16 rounding, and CLTs
that do not fit the model refused naming the tensor and the shape expected."""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from pyspark_safetensors.circuits import (
    ReplacementError,
    ReplacementModel,
    clt_replacement,
    lut_replacement,
    replacement_evaluation,
    transcoder_replacement,
)
from pyspark_safetensors.extract.model import bos_added, load_model
from pyspark_safetensors.extract.toy_lm import TINY, toy_lm, toy_lm_texts
from pyspark_safetensors.lut import LUTMLP, LUTError, load_layer_file, validate_lut
from pyspark_safetensors.lut.evaluate import lm_batches
from pyspark_safetensors.lut.precompute import precompute_clt
from pyspark_safetensors.sae import CrossLayerTranscoder, TranscoderSAE
from pyspark_safetensors.sae.checkpoint import save_sae

L, D, N, K = TINY.num_layers, TINY.hidden_size, 24, 4
BLOCKS = [f"model.layers.{i}.mlp" for i in range(L)]


def _clt(n_layers=L, d=D, blocks=BLOCKS, seed=3, diagonal=False):
    """A CLT of random weights whose outputs are of the MLPs' own size."""
    clt = CrossLayerTranscoder(d, N, K, d_out=D, n_layers=n_layers, seed=seed,
                               hook_points=[f"{b}:input" for b in blocks],
                               target_hook_points=[f"{b}:output" for b in blocks])  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    state = clt.full_state()
    for name, t in state.items():
        scale = 0.15 if name.startswith("decoder_weight") else 0.5
        state[name] = t + scale * torch.randn(t.shape, generator=gen)
        if diagonal and name.startswith("decoder_weight"):
            state[name][:, 1:] = 0
    clt.load_full_state(state)
    return clt.eval()


@pytest.fixture(scope="module")
def toy(tmp_path_factory, seed):
    model_dir = toy_lm(tmp_path_factory.getbasetemp() / "toy-lm", replace(TINY, seed=seed))
    tokenizer, model = load_model(model_dir)
    texts = toy_lm_texts(TINY)[1][:6]
    batches = lm_batches(tokenizer, texts, max_length=TINY.context, batch_size=3)
    return model_dir, tokenizer, model, texts, batches


def _where(tokenizer, batch):
    where = batch["attention_mask"].bool().clone()
    where[:, 0] &= not bos_added(tokenizer)
    return where


def _hand_logits(model, clt, batch, where):
    """The replaced model by hand: hooks on each MLP that encode its input (top k of ReLU
    of the file's encoder), keep the codes, and write ``sum_{l<=t} z_l W^{l->t} + b^t``
    read from the file layout's slots, at ``where``."""
    state, codes = clt.full_state(), []

    def hook(t):
        def post(module, args, out):
            x = args[0]
            pre = x @ state["encoder_weight"][t].T + state["encoder_bias"][t]
            vals, idx = pre.relu().topk(K, dim=-1)
            codes.append(torch.zeros_like(pre).scatter(-1, idx, vals))
            y = state["decoder_bias"][t] + sum(
                codes[s] @ state[f"decoder_weight.{s}"][:, t - s] for s in range(t + 1)
            )
            return torch.where(where[..., None], y, out)

        return post

    handles = [model.get_submodule(b).register_forward_hook(hook(t)) for t, b in enumerate(BLOCKS)]
    try:
        with torch.no_grad():
            return model(**batch).logits
    finally:
        for h in handles:
            h.remove()


def test_the_replaced_logits_equal_a_hand_computation(toy):
    _, tokenizer, model, _, batches = toy
    clt = _clt()
    rm = ReplacementModel(model, clt_replacement(model, clt))
    assert rm.blocks == tuple(BLOCKS)
    with torch.no_grad():
        first_clean = model(**batches[0]).logits
    for batch in batches:
        where = _where(tokenizer, batch)
        run = rm.forward(batch, where=where, record=True)
        want = _hand_logits(model, clt, batch, where)
        torch.testing.assert_close(run.logits, want, rtol=1e-4, atol=1e-4)
        with torch.no_grad():
            clean = model(**batch).logits
        assert (run.logits - clean).abs().max() > 0.1  # the replacement changes something
        # the trace: block 1's output is computed from the replaced run's own input
        t = run.trace
        assert t.codes[BLOCKS[1]].shape == (*batch["input_ids"].shape, N)
        assert (t.codes[BLOCKS[1]] > 0).sum(-1).le(K).all()
        y1 = clt.decode_layer(1, [clt.encode_layer(i, t.inputs[b].reshape(-1, D))
                                  for i, b in enumerate(BLOCKS)])  # fmt: skip
        torch.testing.assert_close(t.replaced[BLOCKS[1]].reshape(-1, D), y1, rtol=1e-4, atol=1e-4)
    # the hooks are gone: the model is clean again
    with torch.no_grad():
        torch.testing.assert_close(model(**batches[0]).logits, first_clean)
    assert all(not model.get_submodule(b)._forward_hooks for b in BLOCKS)


def _direct_figures(model, tokenizer, clt, batches):
    """CE, KL, top-1 of the replaced model and the CE of both ablations, computed here."""
    out = {"clean": 0.0, "clt": 0.0, "kl": 0.0, "top1": 0, "zero": 0.0, "mean": 0.0, "n": 0}
    outputs = {b: [] for b in BLOCKS}
    for batch in batches:  # the mean output of each MLP over the spliced positions
        where = _where(tokenizer, batch)
        hs = [model.get_submodule(b).register_forward_hook(
            lambda m, a, o, b=b, w=where: outputs[b].append(o[w])) for b in BLOCKS]  # fmt: skip
        with torch.no_grad():
            model(**batch)
        for h in hs:
            h.remove()
    means = {b: torch.cat(v).double().mean(0).float() for b, v in outputs.items()}
    for batch in batches:
        _add_direct(model, tokenizer, clt, batch, means, out)
    return out


def _hooked_logp(model, batch, mask, fills=None):
    """Next-token log-probabilities at the real tokens, each MLP's output replaced by
    ``fills[block](output)`` when given."""
    hs = [model.get_submodule(b).register_forward_hook(lambda m, a, o, f=f: f(o))
          for b, f in (fills or {}).items()]  # fmt: skip
    try:
        with torch.no_grad():
            return F.log_softmax(model(**batch).logits[:, :-1].double(), -1)[mask]
    finally:
        for h in hs:
            h.remove()


def _add_direct(model, tokenizer, clt, batch, means, out):
    where = _where(tokenizer, batch)[..., None]
    mask = batch["attention_mask"][:, 1:].bool()
    targets = batch["input_ids"][:, 1:][mask]
    clean = _hooked_logp(model, batch, mask)
    rep = F.log_softmax(_hand_logits(model, clt, batch, where[..., 0])[:, :-1].double(), -1)[mask]
    zero = _hooked_logp(model, batch, mask,
                        {b: lambda o: torch.where(where, 0.0, o) for b in BLOCKS})  # fmt: skip
    mean = _hooked_logp(model, batch, mask,
                        {b: lambda o, b=b: torch.where(where, means[b], o) for b in BLOCKS})  # fmt: skip
    ce = lambda lp: -float(lp.gather(1, targets[:, None]).sum())  # noqa: E731
    out["clean"] += ce(clean)
    out["clt"] += ce(rep)
    out["kl"] += float((clean.exp() * (clean - rep)).sum())
    out["top1"] += int((clean.argmax(1) == rep.argmax(1)).sum())
    out["zero"] += ce(zero)
    out["mean"] += ce(mean)
    out["n"] += len(targets)


def test_the_evaluation_equals_direct_computations(toy):
    _, tokenizer, model, texts, batches = toy
    clt = _clt()
    report = replacement_evaluation(model, tokenizer, texts, {"clt": clt_replacement(model, clt)},
                                    max_length=TINY.context, batch_size=3)  # fmt: skip
    d = _direct_figures(model, tokenizer, clt, batches)
    n = d["n"]
    assert report["tokens"] == n
    got = report["models"]["clt"]
    approx = lambda a, b: pytest.approx(b, rel=1e-4, abs=1e-5) == a  # noqa: E731
    assert approx(report["ce_clean"], d["clean"] / n)
    assert approx(got["ce"], d["clt"] / n)
    assert approx(got["kl"], d["kl"] / n) and got["kl"] > 0.01
    assert got["top1"] == pytest.approx(d["top1"] / n, abs=1.5 / n) and got["top1"] < 1
    assert approx(report["ce_zero_ablated"], d["zero"] / n)
    assert approx(report["ce_mean_ablated"], d["mean"] / n)
    zero, mean, clean = d["zero"] / n, d["mean"] / n, d["clean"] / n
    assert approx(got["ce_loss_recovered"], (zero - d["clt"] / n) / (zero - clean))
    assert approx(got["ce_loss_recovered_mean"], (mean - d["clt"] / n) / (mean - clean))
    # FVU of block 0 is the same in both runs (its input is clean either way); block 1's differ
    fr, fc = got["fvu_replaced"], got["fvu_clean"]
    assert set(fr) == set(fc) == set(BLOCKS)
    assert fr[BLOCKS[0]] == pytest.approx(fc[BLOCKS[0]], rel=1e-6)
    assert fr[BLOCKS[1]] != pytest.approx(fc[BLOCKS[1]], rel=1e-3)


@torch.no_grad()
def _fvu_clean_by_hand(model, tokenizer, clt, batches, block=1):
    err = tot = sq = 0.0
    rows = 0
    for batch in batches:
        where = _where(tokenizer, batch)
        seen = {}
        hs = [model.get_submodule(b).register_forward_hook(
            lambda m, a, o, b=b, seen=seen: seen.__setitem__(b, (a[0], o))) for b in BLOCKS]  # fmt: skip
        with torch.no_grad():
            model(**batch)
        for h in hs:
            h.remove()
        codes = [clt.encode_layer(i, seen[b][0][where]) for i, b in enumerate(BLOCKS)]
        y = seen[BLOCKS[block]][1][where].double()
        err += float((y - clt.decode_layer(block, codes).double()).pow(2).sum())
        tot, sq, rows = tot + y.sum(0), sq + float(y.pow(2).sum()), rows + len(y)
    return err / (sq - float(tot.pow(2).sum()) / rows)


def test_clean_fvu_is_the_clts_on_clean_inputs(toy):
    _, tokenizer, model, texts, batches = toy
    clt = _clt()
    report = replacement_evaluation(model, tokenizer, texts, {"clt": clt_replacement(model, clt)},
                                    max_length=TINY.context, batch_size=3)  # fmt: skip
    got = report["models"]["clt"]["fvu_clean"][BLOCKS[1]]
    assert got == pytest.approx(_fvu_clean_by_hand(model, tokenizer, clt, batches), rel=1e-4)


def test_per_layer_transcoders_are_the_l_to_l_case(toy):
    _, tokenizer, model, _, batches = toy
    clt = _clt(diagonal=True)
    state = clt.full_state()
    tcs = {}
    for t, block in enumerate(BLOCKS):
        tc = TranscoderSAE(D, N, K, d_out=D)
        tc.load_full_state({"encoder_weight": state["encoder_weight"][t],
                            "encoder_bias": state["encoder_bias"][t],
                            "decoder_weight": state[f"decoder_weight.{t}"][:, 0],
                            "decoder_bias": state["decoder_bias"][t]})  # fmt: skip
        tcs[block] = tc.eval()
    per_layer = ReplacementModel(model, transcoder_replacement(model, tcs))
    as_clt = ReplacementModel(model, clt_replacement(model, clt))
    assert all(set(d) == {t} for t, d in enumerate(per_layer.replacement.decoders))
    batch = batches[0]
    where = _where(tokenizer, batch)
    got = per_layer.forward(batch, where=where).logits
    torch.testing.assert_close(got, as_clt.forward(batch, where=where).logits, rtol=1e-5, atol=1e-5)
    # and each block is its transcoder's own output on the replaced run's input
    run = per_layer.forward(batch, where=where, record=True)
    x1 = run.trace.inputs[BLOCKS[1]].reshape(-1, D)
    torch.testing.assert_close(run.trace.replaced[BLOCKS[1]].reshape(-1, D), tcs[BLOCKS[1]](x1).x_hat,
                               rtol=1e-5, atol=1e-5)  # fmt: skip


def test_the_whole_model_lut_gives_the_clts_loss(toy, tmp_path):
    model_dir, tokenizer, model, texts, _ = toy
    clt = _clt()
    save_sae(tmp_path / "clt.safetensors", clt.full_state(), clt.metadata())
    meta = precompute_clt(model_dir, tmp_path / "clt.safetensors", out_dir=tmp_path / "lut")
    assert validate_lut(tmp_path / "lut") == meta
    assert meta["sae_config"] == {"num_basis": N, "k_active": K}
    assert meta["layers"][BLOCKS[1]]["sources"] == BLOCKS
    last = load_layer_file(tmp_path / "lut" / meta["layers"][BLOCKS[1]]["file"])
    assert last["precomputed_products"].shape == (2 * N, D)
    torch.testing.assert_close(last["precomputed_products"][:N], clt.decoder(0, 1),
                               atol=2e-3, rtol=2e-3)  # fmt: skip
    with pytest.raises(LUTError, match="cross-layer"):
        LUTMLP(last, K)
    report = replacement_evaluation(
        model, tokenizer, texts,
        {"clt": clt_replacement(model, clt), "lut": lut_replacement(model, tmp_path / "lut")},
        max_length=TINY.context, batch_size=3,
    )  # fmt: skip
    c, lut = report["models"]["clt"], report["models"]["lut"]
    assert abs(c["ce"] - lut["ce"]) < 2e-3 * c["ce"]
    assert lut["kl"] == pytest.approx(c["kl"], rel=0.05, abs=1e-3)
    assert c["ce"] - report["ce_clean"] > 0.01  # the figures are not all the clean ones


def test_a_clt_that_misfits_the_model_is_refused_naming_the_tensor(toy):
    model = toy[2]
    with pytest.raises(ReplacementError, match=rf"encoder_weight has shape \[{L}, {N}, 24\]; "
                       rf"expected \[{L}, {N}, {D}\]"):  # fmt: skip
        clt_replacement(model, _clt(d=24))
    with pytest.raises(ReplacementError, match=rf"encoder_weight has shape \[3, {N}, {D}\]; "
                       rf"expected \[{L}, {N}, {D}\]"):  # fmt: skip
        clt_replacement(model, _clt(n_layers=3, blocks=()))
    with pytest.raises(ReplacementError, match=r"model.layers.7.mlp:input' names no MLP block"):
        clt_replacement(model, _clt(blocks=[BLOCKS[0], "model.layers.7.mlp"]))
    with pytest.raises(ReplacementError, match=r"not in layer order"):
        clt_replacement(model, _clt(blocks=BLOCKS[::-1]))
    wide = TranscoderSAE(D, N, K, d_out=D + 1)
    with pytest.raises(ReplacementError, match=rf"decoder_weight has shape \[{N}, {D + 1}\]"):
        transcoder_replacement(model, {BLOCKS[0]: wide})
