"""Dictionaries as other libraries write them, in the one replacement model: circuit-tracer's
CLT (``W_enc_{l}``/``W_dec_{l}`` files) and per-layer transcoder sets (``layer_{l}``
files, JumpReLU or ReLU, with skip paths, a YAML config naming hooks and ``hf://`` files
or none), sparsify's per-layer transcoders (a directory per hook point) and cross-layer
runs. Each block's replaced output on the toy Llama equals the peer's definition computed
here from its files (always), and circuit-tracer's own loaders on the inputs the replaced
run fed each block (when ``.venv-circuit-tracer`` exists, which also writes its files with
circuit-tracer's own classes). Block names in every library's convention resolve by one
rule (``block_of``); the threshold rule is refused for a dictionary without thresholds
(``threshold_source``), the top-k rule for one without a k, each saying what to do; per-
layer transcoders with thresholds export to circuit-tracer's set and load in its
``load_transcoder_set``.

sparsify's files are written by hand after its code: ``SparseCoder.save_to_disk`` (PyPI
eai-sparsify 1.3.3: ``cfg.json`` = its config + ``d_in``, ``sae.safetensors`` = the module's
state, ``encoder.weight``, ``encoder.bias``, ``W_dec``, ``b_dec``, ``W_skip``), in a
directory named by the hook point relative to the model's base model; its cross-layer
layout (``W_decs.{j}``, ``b_decs.{j}``, ``post_encs.{j}``, ``n_targets``) is on a branch
PyPI does not ship, after ``sae/clt_interop.py``'s account of it."""

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file

from pyspark_safetensors.circuits import (
    ReplacementError,
    ReplacementModel,
    load_replacement,
)
from pyspark_safetensors.circuits.replacement import block_layers, model_blocks
from pyspark_safetensors.extract.model import load_model
from pyspark_safetensors.extract.toy_lm import TINY, toy_lm, toy_lm_texts
from pyspark_safetensors.lut.evaluate import lm_batches
from pyspark_safetensors.sae import CheckpointError, export_sae, read_sae, save_sae
from pyspark_safetensors.sae.architectures import CrossLayerTranscoder
from pyspark_safetensors.sae.architectures.clt import block_of

L, D, N, K = TINY.num_layers, TINY.hidden_size, 24, 3
BLOCKS = [f"model.layers.{i}.mlp" for i in range(L)]
REPO = Path(__file__).resolve().parents[2]
CT_PYTHON = REPO / ".venv-circuit-tracer" / "bin" / "python"
needs_ct = pytest.mark.skipif(
    not CT_PYTHON.is_file(), reason="no .venv-circuit-tracer (circuit-tracer 0.5.0's own venv)"
)


# --- the model and a replaced run -------------------------------------------------------


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """``(model directory, model, one batch)`` of the tiny toy Llama."""
    model_dir = toy_lm(tmp_path_factory.getbasetemp() / "toy-lm", TINY)
    tokenizer, model = load_model(model_dir)
    texts = toy_lm_texts(TINY)[1][:2]
    batch = lm_batches(tokenizer, texts, max_length=TINY.context, batch_size=2)[0]
    return model_dir, model, batch


def _replaced(model, batch, dictionary, **kwargs):
    """Each block's recorded input ``[R, D]`` and replaced output ``[R, D]`` (the model's
    blocks in order) of one replaced forward pass."""
    rm = ReplacementModel(model, load_replacement(model, dictionary, **kwargs))
    assert rm.blocks == tuple(BLOCKS) and rm.layers == list(range(L))
    trace = rm.forward(batch, record=True).trace
    for b in BLOCKS:  # some latents fire and some do not: the rule is exercised
        assert 0.02 < float((trace.codes[b] != 0).float().mean()) < 0.98, b
    return ([trace.inputs[b].reshape(-1, D) for b in BLOCKS],
            [trace.replaced[b].reshape(-1, D) for b in BLOCKS])  # fmt: skip


def _close(got, want):
    for t, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=f"block {t}")


# --- the peers' definitions, from their files ---------------------------------------------


def _jumprelu(pre, threshold):
    """circuit-tracer's ``jumprelu.forward``: ``x * (x > threshold)``; ``F.relu`` without."""
    return pre.relu() if threshold is None else pre * (pre > threshold)


def ct_clt_outputs(directory, xs):
    """circuit-tracer's CLT (``CrossLayerTranscoder.encode`` / ``compute_reconstruction``):
    ``features_l = JumpReLU(x_l W_enc_l^T + b_enc_l)``, layer t's output ``b_dec_t +
    sum_{l <= t} features_l W_dec_l[:, t - l]``."""
    enc = [load_file(Path(directory) / f"W_enc_{i}.safetensors") for i in range(L)]
    dec = [load_file(Path(directory) / f"W_dec_{i}.safetensors")[f"W_dec_{i}"] for i in range(L)]
    feats = [_jumprelu(x @ e[f"W_enc_{i}"].T + e[f"b_enc_{i}"], e.get(f"threshold_{i}"))
             for i, (x, e) in enumerate(zip(xs, enc, strict=True))]  # fmt: skip
    return [enc[t][f"b_dec_{t}"] + sum(feats[s] @ dec[s][:, t - s] for s in range(t + 1))
            for t in range(L)]  # fmt: skip


def ct_transcoder_output(path, x):
    """circuit-tracer's ``SingleLayerTranscoder.forward``: ``JumpReLU(F.linear(x, W_enc,
    b_enc)) @ W_dec + b_dec (+ x @ W_skip.T)``."""
    t = load_file(path)
    acts = _jumprelu(x @ t["W_enc"].T + t["b_enc"], t.get("activation_function.threshold"))
    out = acts @ t["W_dec"] + t["b_dec"]
    return out + x @ t["W_skip"].T if "W_skip" in t else out


def _topk(pre, k):
    """sparsify's ``fused_encoder`` (topk): the top k of ``ReLU(pre)``, dense."""
    vals, idx = pre.relu().topk(k, dim=-1)
    return torch.zeros_like(pre).scatter(-1, idx, vals)


def sparsify_transcoder_output(directory, x):
    """sparsify's ``SparseCoder.forward`` with ``transcode`` (the input read uncentred):
    ``decode(TopK(ReLU(encoder(x)))) + x @ W_skip.mT``."""
    t = load_file(Path(directory) / "sae.safetensors")
    k = json.loads((Path(directory) / "cfg.json").read_text())["k"]
    out = _topk(x @ t["encoder.weight"].T + t["encoder.bias"], k) @ t["W_dec"] + t["b_dec"]
    return out + x @ t["W_skip"].mT if "W_skip" in t else out


def sparsify_clt_outputs(root, hooks, xs):
    """sparsify's cross-layer coders: layer t's output ``sum_{l <= t} z_l W_decs^l.{t-l}
    + b_decs^l.{t-l}``, ``z_l`` the top k of ``ReLU(encoder^l(x_l))``."""
    ts = [load_file(Path(root) / h / "sae.safetensors") for h in hooks]
    z = [
        _topk(x @ t["encoder.weight"].T + t["encoder.bias"], K) for x, t in zip(xs, ts, strict=True)
    ]
    return [sum(z[s] @ ts[s][f"W_decs.{t - s}"] + ts[s][f"b_decs.{t - s}"] for s in range(t + 1))
            for t in range(L)]  # fmt: skip


# --- the peers' files, written by hand after their code -------------------------------------


def _randn(gen, *shape, scale=1.0):
    return scale * torch.randn(*shape, generator=gen)


def write_ct_clt(directory, *, seed=0, thresholds=True, config=None):
    """``CrossLayerTranscoder.to_safetensors``'s files: ``W_enc_{i}.safetensors`` (``W_enc_{i}
    [n, d]``, ``b_enc_{i}``, ``b_dec_{i}``, ``threshold_{i}`` for a JumpReLU CLT) and
    ``W_dec_{i}.safetensors`` (``W_dec_{i} [n, L - i, d]``); ``config`` as its YAML."""
    gen = torch.Generator().manual_seed(seed)
    directory.mkdir(parents=True)
    for i in range(L):
        enc = {f"W_enc_{i}": _randn(gen, N, D, scale=0.4), f"b_enc_{i}": _randn(gen, N, scale=0.2),
               f"b_dec_{i}": _randn(gen, D, scale=0.1)}  # fmt: skip
        if thresholds:
            enc[f"threshold_{i}"] = _randn(gen, N).abs()
        save_file(enc, directory / f"W_enc_{i}.safetensors")
        save_file({f"W_dec_{i}": _randn(gen, N, L - i, D, scale=0.1)},
                  directory / f"W_dec_{i}.safetensors")  # fmt: skip
    if config is not None:
        (directory / "config.yaml").write_text(config)


#: circuit-tracer's configs as its Hugging Face repositories write them (YAML).
CT_CLT_CONFIG = """\
model_name: toy-llama
model_kind: cross_layer_transcoder
repo_id: someone/clt-toy
feature_input_hook: mlp.hook_in
feature_output_hook: mlp.hook_out
scan: someone/clt-toy
"""
CT_SET_CONFIG = """\
model_kind: transcoder_set
feature_input_hook: mlp.hook_in
feature_output_hook: mlp.hook_out
scan: someone/tc-toy
transcoders:
""" + "".join(f"  - hf://someone/tc-toy/layer_{i}.safetensors\n" for i in range(L))


def write_ct_set(directory, *, seed=1, thresholds=True, skip=True, config=CT_SET_CONFIG):
    """``TranscoderSet.to_safetensors``'s files: ``layer_{i}.safetensors`` with ``W_enc [n,
    d]``, ``W_dec [n, d]``, ``b_enc``, ``b_dec``, ``activation_function.threshold`` (JumpReLU)
    and ``W_skip [d, d]``."""
    gen = torch.Generator().manual_seed(seed)
    directory.mkdir(parents=True)
    for i in range(L):
        t = {"W_enc": _randn(gen, N, D, scale=0.4), "W_dec": _randn(gen, N, D, scale=0.1),
             "b_enc": _randn(gen, N, scale=0.2), "b_dec": _randn(gen, D, scale=0.1)}  # fmt: skip
        if thresholds:
            t["activation_function.threshold"] = _randn(gen, N).abs()
        if skip:
            t["W_skip"] = _randn(gen, D, D, scale=0.05)
        save_file(t, directory / f"layer_{i}.safetensors")
    if config is not None:
        (directory / "config.yaml").write_text(config)


def write_sparsify_transcoders(root, *, seed=2):
    """A sparsify run of skip transcoders on each MLP (``SparseCoder.save_to_disk`` under
    the hook point, ``layers.{i}.mlp``)."""
    gen = torch.Generator().manual_seed(seed)
    for i in range(L):
        sub = root / f"layers.{i}.mlp"
        sub.mkdir(parents=True)
        save_file({"encoder.weight": _randn(gen, N, D, scale=0.4),
                   "encoder.bias": _randn(gen, N, scale=0.2), "W_dec": _randn(gen, N, D, scale=0.1),
                   "b_dec": _randn(gen, D, scale=0.1), "W_skip": _randn(gen, D, D, scale=0.05)},
                  sub / "sae.safetensors")  # fmt: skip
        cfg = {"activation": "topk", "expansion_factor": 1, "normalize_decoder": True,
               "num_latents": N, "k": K, "multi_topk": False, "skip_connection": True,
               "transcode": True, "d_in": D}  # fmt: skip
        (sub / "cfg.json").write_text(json.dumps(cfg))
    return [f"layers.{i}.mlp" for i in range(L)]


def write_sparsify_clt(root, *, seed=3):
    """A sparsify cross-layer run (``cross_layer``, ``coalesce_topk = "none"``): per hook
    point ``W_decs.{j}``, ``b_decs.{j}`` and ``post_encs.{j}`` for each of its ``n_targets``."""
    gen = torch.Generator().manual_seed(seed)
    hooks = [f"layers.{i}.mlp" for i in range(L)]
    for i, hook in enumerate(hooks):
        sub = root / hook
        sub.mkdir(parents=True)
        t = {
            "encoder.weight": _randn(gen, N, D, scale=0.4),
            "encoder.bias": _randn(gen, N, scale=0.2),
        }
        for j in range(L - i):
            t |= {f"W_decs.{j}": _randn(gen, N, D, scale=0.1), f"b_decs.{j}": _randn(gen, D, scale=0.1),
                  f"post_encs.{j}": torch.zeros(N)}  # fmt: skip
        save_file(t, sub / "sae.safetensors")
        cfg = {"activation": "topk", "expansion_factor": 1, "normalize_decoder": True,
               "num_latents": N, "k": K, "multi_topk": False, "skip_connection": False,
               "transcode": True, "n_targets": L - i, "n_sources": i + 1, "normalize_io": False,
               "divide_cross_layer": False, "train_post_encoder": False,
               "post_encoder_scale": False, "coalesce_topk": "none", "d_in": D}  # fmt: skip
        (sub / "cfg.json").write_text(json.dumps(cfg))
    return hooks


# --- the tests that need no optional environment ---------------------------------------------


def test_circuit_tracer_files_give_circuit_tracers_outputs(toy, tmp_path):
    _, model, batch = toy
    write_ct_clt(tmp_path / "clt", config=CT_CLT_CONFIG)
    xs, got = _replaced(model, batch, tmp_path / "clt", rule="threshold")
    _close(got, ct_clt_outputs(tmp_path / "clt", xs))
    assert read_sae(tmp_path / "clt")[1]["threshold_source"] == "peer"
    # its files alone, no config: the model's blocks in order; a ReLU CLT (no thresholds)
    write_ct_clt(tmp_path / "relu", thresholds=False)
    xs, got = _replaced(model, batch, tmp_path / "relu", rule="threshold")
    _close(got, ct_clt_outputs(tmp_path / "relu", xs))
    # a JumpReLU set with skip paths, its config's files hf:// URIs named here
    write_ct_set(tmp_path / "set")
    xs, got = _replaced(model, batch, tmp_path / "set", rule="threshold")
    _close(got, [ct_transcoder_output(tmp_path / "set" / f"layer_{t}.safetensors", x)
                 for t, x in enumerate(xs)])  # fmt: skip
    # a ReLU set without a config; and its files one by one, named in any convention
    write_ct_set(tmp_path / "relu-set", thresholds=False, skip=False, config=None)
    files = {f"blocks.{i}.mlp.hook_in": tmp_path / "relu-set" / f"layer_{i}.safetensors"
             for i in range(L)}  # fmt: skip
    for dictionary in (tmp_path / "relu-set", files):
        xs, got = _replaced(model, batch, dictionary, rule="threshold")
        _close(got, [ct_transcoder_output(files[f"blocks.{t}.mlp.hook_in"], x)
                     for t, x in enumerate(xs)])  # fmt: skip


def test_sparsify_files_give_sparsifys_outputs(toy, tmp_path):
    _, model, batch = toy
    hooks = write_sparsify_transcoders(tmp_path / "per-layer")
    xs, got = _replaced(model, batch, tmp_path / "per-layer")
    _close(got, [sparsify_transcoder_output(tmp_path / "per-layer" / h, x)
                 for h, x in zip(hooks, xs, strict=True)])  # fmt: skip
    # one coder directory alone names its block by its name, as sparsify does
    one = load_replacement(model, tmp_path / "per-layer" / hooks[1])
    assert one.blocks == (BLOCKS[1],) and one.skip[0] is not None
    hooks = write_sparsify_clt(tmp_path / "clt")
    xs, got = _replaced(model, batch, tmp_path / "clt")
    _close(got, sparsify_clt_outputs(tmp_path / "clt", hooks, xs))
    assert read_sae(tmp_path / "clt")[1]["threshold_source"] is None


def test_the_one_rule_of_block_names():
    llama = [f"model.layers.{i}.mlp" for i in range(3)]
    gpt2 = [f"transformer.h.{i}.mlp" for i in range(3)]
    for name in ("model.layers.1.mlp", "model.layers.1.mlp:input", "model.layers.1.mlp:output",
                 "layers.1.mlp", "blocks.1.mlp", "blocks.1.mlp.hook_in", "blocks.1.mlp.hook_out",
                 "blocks.1.ln2.hook_normalized", "blocks.1.hook_mlp_out",
                 "model.layers.1.mlp.hook_in"):  # fmt: skip
        assert block_of(name, llama) == llama[1], name
    for name in (
        "transformer.h.2.mlp",
        "h.2.mlp",
        "blocks.2.mlp.hook_in",
        "transformer.h.2.mlp:input",
    ):
        assert block_of(name, gpt2) == gpt2[2], name
    assert block_of("model.layers.1.mlp:input") == "model.layers.1.mlp"  # no model: the module
    for name in ("blocks.1.hook_resid_mid", "blocks.1.hook_mlp_in"):  # before the MLP's norm
        with pytest.raises(ValueError, match="residual stream before block 1's MLP norm"):
            block_of(name, llama)
    for name in ("model.layers.7.mlp", "blocks.3.mlp.hook_in", "transformer.h.0.mlp",
                 "blocks.0.attn.hook_z", "mlp"):  # fmt: skip
        with pytest.raises(ValueError, match=r"names no MLP block of the model; its blocks: "
                           r"\['model.layers.0.mlp'"):  # fmt: skip
            block_of(name, llama)


def test_peer_block_names_resolve_and_unknown_ones_are_refused(toy, tmp_path):
    _, model, _ = toy
    assert model_blocks(model) == BLOCKS
    assert block_layers(model, ["blocks.1.mlp.hook_in", "layers.0.mlp"]) == [1, 0]
    write_ct_clt(tmp_path / "resid", config=CT_CLT_CONFIG.replace("mlp.hook_in", "hook_resid_mid"))
    with pytest.raises(ReplacementError, match="residual stream before block 0's MLP norm"):
        load_replacement(model, tmp_path / "resid", rule="threshold")
    write_ct_set(tmp_path / "set")
    files = {"blocks.0.mlp.hook_in": tmp_path / "set" / "layer_0.safetensors",
             "model.layers.9.mlp": tmp_path / "set" / "layer_1.safetensors"}  # fmt: skip
    with pytest.raises(ReplacementError, match=r"'model.layers.9.mlp' names no MLP block of the "
                       r"model; its blocks: \['model.layers.0.mlp', 'model.layers.1.mlp'\]"):  # fmt: skip
        load_replacement(model, files, rule="threshold")
    files = {
        "blocks.0.mlp.hook_in": files["blocks.0.mlp.hook_in"],
        "layers.0.mlp": files["model.layers.9.mlp"],
    }
    with pytest.raises(ReplacementError, match="one each"):
        load_replacement(model, files, rule="threshold")
    write_ct_set(tmp_path / "short", config=None)
    (tmp_path / "short" / "layer_1.safetensors").unlink()
    with pytest.raises(ReplacementError, match=r"no config.yaml naming their hooks, so they must "
                       r"be the model's 2 MLP blocks"):  # fmt: skip
        load_replacement(model, tmp_path / "short", rule="threshold")


def _our_transcoders(tmp_path, *, thresholds=None, skip=False, seed=4):
    """Per-layer transcoder files of ours recording their blocks; with ``thresholds`` (a
    ``threshold_source``) each carries a ``threshold`` tensor."""
    gen, paths = torch.Generator().manual_seed(seed), []
    tmp_path.mkdir(parents=True)
    for i in range(L):
        t = {"encoder_weight": _randn(gen, N, D, scale=0.4), "encoder_bias": _randn(gen, N, scale=0.2),
             "decoder_weight": _randn(gen, N, D, scale=0.1), "decoder_bias": _randn(gen, D, scale=0.1)}  # fmt: skip
        meta = {"architecture": "skip_transcoder" if skip else "transcoder", "k": str(K),
                "hook_point": f"{BLOCKS[i]}:input", "target_hook_point": f"{BLOCKS[i]}:output"}  # fmt: skip
        if skip:
            t["skip_weight"] = _randn(gen, D, D, scale=0.05)
        if thresholds:
            t["threshold"], meta["threshold_source"] = _randn(gen, N).abs(), thresholds
        paths.append(tmp_path / f"tc{i}.safetensors")
        save_sae(paths[-1], t, meta)
    return paths


def test_the_threshold_rule_is_refused_without_thresholds(toy, tmp_path):
    _, model, batch = toy
    topk = _our_transcoders(tmp_path / "topk")
    sparsify = tmp_path / "sparsify"
    write_sparsify_transcoders(sparsify)
    write_sparsify_clt(tmp_path / "sparsify-clt")
    clt = CrossLayerTranscoder(
        D, N, K, d_out=D, n_layers=L, hook_points=[f"{b}:input" for b in BLOCKS]
    )
    save_sae(tmp_path / "never.safetensors", clt.full_state(), clt.metadata())  # thresholds 0
    refused = {
        "per-layer top-k transcoders": (
            topk,
            r"\['.*tc0.safetensors', '.*tc1.safetensors'\] hold "
            "no JumpReLU thresholds",
        ),
        "sparsify's transcoders": (sparsify, "layers.0.mlp', '.*layers.1.mlp'] hold no JumpReLU"),
        "sparsify's CLT": (
            tmp_path / "sparsify-clt",
            r"the CLT \(sparsify, which keeps the top "
            "k per layer\\) holds no JumpReLU thresholds",
        ),
        "a CLT never calibrated": (tmp_path / "never.safetensors", r"the CLT \(ours\) holds no"),
        "its module": (clt, r"the CLT: rule 'threshold': the CLT \(ours\) holds no"),
    }
    for what, (dictionary, match) in refused.items():
        with pytest.raises(ReplacementError, match=match) as e:
            load_replacement(model, dictionary, rule="threshold")
        assert "use rule='topk'" in str(e.value) and "calibrate" in str(e.value), what
        load_replacement(model, dictionary)  # the top-k rule is theirs
    # a calibrated CLT records it; an old file of ours with thresholds but no key is read so
    clt.eval()
    x = torch.randn(64, L * D)
    clt.calibrate_thresholds([x])
    assert clt.metadata()["threshold_source"] == "calibrated"
    save_sae(tmp_path / "calibrated.safetensors", clt.full_state(), clt.metadata())
    meta = dict(clt.metadata())
    del meta["threshold_source"]
    save_sae(tmp_path / "old.safetensors", clt.full_state(), meta)
    for name in ("calibrated", "old"):
        path = tmp_path / f"{name}.safetensors"
        assert read_sae(path)[1]["threshold_source"] == "calibrated"
        assert load_replacement(model, path, rule="threshold").rule == "threshold"
    # per-layer transcoders that carry thresholds use them
    trained = _our_transcoders(tmp_path / "trained", thresholds="trained", skip=True)
    xs, got = _replaced(model, batch, trained, rule="threshold")
    for t, (x, path) in enumerate(zip(xs, trained, strict=True)):
        f = load_file(path)
        pre = x @ f["encoder_weight"].T + f["encoder_bias"]
        want = _jumprelu(pre, f["threshold"]) @ f["decoder_weight"] + f["decoder_bias"]
        torch.testing.assert_close(got[t], want + x @ f["skip_weight"].T, rtol=1e-5, atol=1e-5)
    # the top-k rule needs a k: circuit-tracer's files record none
    write_ct_set(tmp_path / "set")
    with pytest.raises(ReplacementError, match=r"rule 'topk': .* record no k .* pass k="):
        load_replacement(model, tmp_path / "set")
    assert load_replacement(model, tmp_path / "set", k=K).k == K
    write_ct_clt(tmp_path / "ct-clt")
    with pytest.raises(ReplacementError, match=r"the CLT \(circuit-tracer\) records no k"):
        load_replacement(model, tmp_path / "ct-clt")
    assert load_replacement(model, tmp_path / "ct-clt", k=K).rule == "topk"


def test_what_circuit_tracer_cannot_hold_is_not_exported(tmp_path):
    topk = _our_transcoders(tmp_path / "topk")
    with pytest.raises(CheckpointError, match=r"holds no JumpReLU thresholds .* a ReLU"):
        export_sae(topk, tmp_path / "out", "circuit-tracer-transcoders")
    with pytest.raises(CheckpointError, match="pass the transcoder files as a list"):
        export_sae(topk[0], tmp_path / "out", "circuit-tracer-transcoders")
    trained = _our_transcoders(tmp_path / "trained", thresholds="trained")
    with pytest.raises(CheckpointError, match="not one per layer in layer order"):
        export_sae(trained[::-1], tmp_path / "out", "circuit-tracer-transcoders")
    clt = CrossLayerTranscoder(D, N, K, d_out=D, n_layers=L)
    save_sae(tmp_path / "never.safetensors", clt.full_state(), clt.metadata())
    with pytest.raises(CheckpointError, match="the CLT holds no JumpReLU thresholds"):
        export_sae(tmp_path / "never.safetensors", tmp_path / "out", "circuit-tracer")
    assert not (tmp_path / "out").exists()
    out = export_sae(trained, tmp_path / "set", "circuit-tracer-transcoders")
    config = json.loads((out / "config.yaml").read_text())
    assert config["blocks"] == BLOCKS and config["threshold_source"] == "trained"
    assert config["k"] == K and config["feature_input_hook"] == "mlp.hook_in"
    tensors, info = read_sae(out)
    assert info["threshold_source"] == "trained"  # ours survives the round trip
    for i, path in enumerate(trained):
        assert torch.equal(tensors["threshold"][i], load_file(path)["threshold"])


def test_a_graph_through_circuit_tracers_clt(toy, tmp_path):
    from pyspark_safetensors.graphs.attribution import attribute

    model_dir, _, batch = toy
    write_ct_clt(tmp_path / "clt", config=CT_CLT_CONFIG)
    rm = ReplacementModel.load(model_dir, tmp_path / "clt", rule="threshold")
    tokens = batch["input_ids"][0][batch["attention_mask"][0].bool()][:8]
    graph = attribute(rm, tokens)
    clean = rm.forward({"input_ids": tokens[None]}, replace=False, record=True).trace
    want = {(t, p, i) for t, b in enumerate(BLOCKS)
            for p, i in zip(*torch.nonzero(clean.codes[b][0], as_tuple=True), strict=True)
            if p >= 1}  # fmt: skip
    got = {(int(t), int(p), int(i))
           for t, p, i in zip(graph.feature_layer, graph.feature_pos, graph.feature_latent, strict=True)}  # fmt: skip
    assert got and got == {(t, int(p), int(i)) for t, p, i in want}


# --- against circuit-tracer's own code -------------------------------------------------------

CT_SCRIPT = textwrap.dedent('''
    """Run by circuit-tracer 0.5.0's venv: ``write ROOT L N D`` writes a CLT and transcoder
    sets with its own classes; ``run ROOT`` loads them with its own loaders and writes each
    one's outputs on the inputs in ROOT/inputs.safetensors."""
    import sys
    from pathlib import Path

    import torch
    import torch.nn.functional as F
    import yaml
    from safetensors.torch import load_file, save_file

    from circuit_tracer.transcoder.activation_functions import JumpReLU
    from circuit_tracer.transcoder.cross_layer_transcoder import CrossLayerTranscoder, load_clt
    from circuit_tracer.transcoder.single_layer_transcoder import (
        SingleLayerTranscoder, TranscoderSet, load_transcoder_set)

    CPU, F32 = torch.device("cpu"), torch.float32
    HOOKS = {"feature_input_hook": "mlp.hook_in", "feature_output_hook": "mlp.hook_out"}


    def fill(params, gen):
        with torch.no_grad():
            for p in params:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))


    def write(root, L, N, D):
        gen = torch.Generator().manual_seed(0)
        clt = CrossLayerTranscoder(L, N, D, activation_function="jump_relu", lazy_decoder=False,
                                   device=CPU, dtype=F32)
        fill(clt.parameters(), gen)
        with torch.no_grad():
            clt.activation_function.threshold.abs_()
        clt.to_safetensors(str(root / "clt"))
        doc = {"model_kind": "cross_layer_transcoder", "repo_id": "someone/clt", "scan": "x", **HOOKS}
        (root / "clt" / "config.yaml").write_text(yaml.safe_dump(doc))
        for name, jump, skip in (("set", True, True), ("relu-set", False, False)):
            plts = {}
            for layer in range(L):
                act = JumpReLU(torch.rand(N, generator=gen), 0.1) if jump else F.relu
                t = SingleLayerTranscoder(D, N, act, layer, skip_connection=skip, device=CPU,
                                          dtype=F32)
                fill([t.W_enc, t.W_dec, t.b_enc, t.b_dec] + ([t.W_skip] if skip else []), gen)
                plts[layer] = t
            TranscoderSet(plts, **HOOKS).to_safetensors(str(root / name))
            files = [f"layer_{layer}.safetensors" for layer in range(L)]
            doc = {"model_kind": "transcoder_set", "scan": "x", "transcoders": files, **HOOKS}
            (root / name / "config.yaml").write_text(yaml.safe_dump(doc))


    def run(root):
        inputs, out = load_file(root / "inputs.safetensors"), {}
        for key, x in inputs.items():
            name, _ = key.split(":")
            cfg = yaml.safe_load((root / name / "config.yaml").read_text())
            hooks = {k: cfg[k] for k in HOOKS}
            if cfg["model_kind"] == "cross_layer_transcoder":
                clt = load_clt(str(root / name), device=CPU, dtype=F32, **hooks)
                with torch.no_grad():
                    out[key] = clt(x)  # [L, R, D]: its forward, its lazy decoder
            else:
                paths = {i: str(root / name / f) for i, f in enumerate(cfg["transcoders"])}
                tset = load_transcoder_set(paths, cfg.get("scan"), device=CPU, **hooks)
                with torch.no_grad():
                    out[key] = torch.stack([tset[i](x[i]) for i in range(len(x))])
        save_file({k: v.contiguous() for k, v in out.items()}, root / "outputs.safetensors")


    if sys.argv[1] == "write":
        write(Path(sys.argv[2]), *map(int, sys.argv[3:6]))
    else:
        run(Path(sys.argv[2]))
''')


def _circuit_tracer(root: Path, *args: str) -> None:
    script = root / "ct_script.py"
    script.write_text(CT_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    done = subprocess.run([str(CT_PYTHON), str(script), *args], capture_output=True, text=True,
                          env=env, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]


@needs_ct
def test_circuit_tracers_own_files_and_loaders_agree_with_the_replacement(toy, tmp_path):
    _, model, batch = toy
    _circuit_tracer(tmp_path, "write", str(tmp_path), str(L), str(N), str(D))
    assert sorted(p.name for p in (tmp_path / "clt").iterdir())[:3] == [
        "W_dec_0.safetensors", "W_dec_1.safetensors", "W_enc_0.safetensors"]  # fmt: skip
    inputs, ours = {}, {}
    for name in ("clt", "set", "relu-set"):
        xs, got = _replaced(model, batch, tmp_path / name, rule="threshold")
        inputs[f"{name}:x"], ours[name] = torch.stack(xs).contiguous(), got
    save_file(inputs, tmp_path / "inputs.safetensors")
    _circuit_tracer(tmp_path, "run", str(tmp_path))
    theirs = load_file(tmp_path / "outputs.safetensors")
    for name, got in ours.items():
        assert theirs[f"{name}:x"].shape == (L, *got[0].shape), name
        torch.testing.assert_close(torch.stack(got), theirs[f"{name}:x"], rtol=1e-5, atol=1e-5,
                                   msg=name)  # fmt: skip


@needs_ct
def test_circuit_tracer_loads_our_per_layer_transcoders_as_a_set(toy, tmp_path):
    _, model, batch = toy
    trained = _our_transcoders(tmp_path / "ours", thresholds="trained", skip=True)
    export_sae(trained, tmp_path / "set", "circuit-tracer-transcoders")
    xs, got = _replaced(model, batch, trained, rule="threshold")
    save_file({"set:x": torch.stack(xs).contiguous()}, tmp_path / "inputs.safetensors")
    _circuit_tracer(tmp_path, "run", str(tmp_path))
    theirs = load_file(tmp_path / "outputs.safetensors")["set:x"]
    torch.testing.assert_close(torch.stack(got), theirs, rtol=1e-5, atol=1e-5)
