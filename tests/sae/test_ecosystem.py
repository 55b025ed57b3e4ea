"""SAEs of other trainers: tiny SAELens and sparsify directories built the way those
libraries lay them out, read into our convention with the same encoding; ours exported
to both layouts and read back; a foreign SAE fine-tuned, turned into a LUT, evaluated."""

import json

import numpy as np
import pytest
import safetensors.torch
import torch

from pyspark_safetensors.sae import (
    CheckpointError,
    SAEConfig,
    export_sae,
    load_sae_model,
    read_sae,
    save_sae,
)
from pyspark_safetensors.sae.train import Trainer

D, N, K = 8, 32, 4


def _random(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "W_enc": torch.randn(D, N, generator=g),
        "b_enc": 0.1 * torch.randn(N, generator=g),
        "W_dec": torch.randn(N, D, generator=g) * torch.rand(N, 1, generator=g).add(0.5),
        "b_dec": torch.randn(D, generator=g),
    }


def saelens_dir(root, w, *, apply_b_dec_to_input=True, rescale=False):
    """SAELens' on-disk layout: cfg.json + sae_weights.safetensors (W_enc is [d_in, d_sae])."""
    root.mkdir(parents=True)
    safetensors.torch.save_file(w, root / "sae_weights.safetensors")
    cfg = {"architecture": "topk", "d_in": D, "d_sae": N, "k": K, "dtype": "float32",
           "device": "cpu", "apply_b_dec_to_input": apply_b_dec_to_input,
           "normalize_activations": "none", "rescale_acts_by_decoder_norm": rescale,
           "metadata": {"hook_name": "blocks.0.hook_resid_pre"}}  # fmt: skip
    (root / "cfg.json").write_text(json.dumps(cfg))
    return root


def saelens_forward(w, x, *, apply_b_dec_to_input, rescale):
    """SAELens' TopK SAE as its code computes it (encode, top-k, decode)."""
    sae_in = x - w["b_dec"] if apply_b_dec_to_input else x
    pre = sae_in @ w["W_enc"] + w["b_enc"]
    norm = w["W_dec"].norm(dim=-1)
    if rescale:
        pre = pre * norm
    v, i = pre.topk(K, dim=-1)
    acts = torch.zeros_like(pre).scatter(-1, i, v.relu())
    if rescale:
        acts = acts / norm
    return acts @ w["W_dec"] + w["b_dec"]


def sparsify_dir(root, w):
    """sparsify's layout: cfg.json (with d_in) + sae.safetensors (nn.Linear encoder)."""
    root.mkdir(parents=True)
    tensors = {"encoder.weight": w["W_enc"].T.contiguous(), "encoder.bias": w["b_enc"],
               "W_dec": w["W_dec"], "b_dec": w["b_dec"]}  # fmt: skip
    safetensors.torch.save_file(tensors, root / "sae.safetensors")
    d, n = w["W_enc"].shape
    cfg = {"activation": "topk", "expansion_factor": n // d, "normalize_decoder": True,
           "num_latents": n, "k": K, "multi_topk": False, "skip_connection": False,
           "transcode": False, "d_in": d}  # fmt: skip
    (root / "cfg.json").write_text(json.dumps(cfg))
    return root


@pytest.mark.parametrize("apply_b_dec_to_input", [True, False])
@pytest.mark.parametrize("rescale", [False, True])
def test_saelens_topk_sae_encodes_the_same(tmp_path, apply_b_dec_to_input, rescale):
    w = _random()
    path = saelens_dir(tmp_path / "sl", w, apply_b_dec_to_input=apply_b_dec_to_input,
                       rescale=rescale)  # fmt: skip
    sae = load_sae_model(path)
    assert (sae.d, sae.n_latents, sae.k) == (D, N, K)
    x = torch.randn(64, D)
    want = saelens_forward(w, x, apply_b_dec_to_input=apply_b_dec_to_input, rescale=rescale)
    with torch.no_grad():
        torch.testing.assert_close(sae(x).x_hat, want, rtol=1e-4, atol=1e-4)
    if rescale:  # the norms were folded into the encoder: unit decoder rows
        torch.testing.assert_close(sae.decoder_weight.norm(dim=1), torch.ones(N))


def test_sparsify_sae_encodes_the_same_and_round_trips(tmp_path):
    w = _random(1)
    sae = load_sae_model(sparsify_dir(tmp_path / "sp", w))
    x = torch.randn(64, D)
    want = saelens_forward(w, x, apply_b_dec_to_input=True, rescale=False)  # same formula
    with torch.no_grad():
        torch.testing.assert_close(sae(x).x_hat, want, rtol=1e-4, atol=1e-4)
        values, indices = sae.encode(x)
        torch.testing.assert_close(sae.decode(values, indices), want, rtol=1e-4, atol=1e-4)
    # ours -> both layouts -> ours: the same tensors and k
    ours = {"encoder_weight": w["W_enc"].T.contiguous(), "encoder_bias": w["b_enc"],
            "decoder_weight": w["W_dec"], "decoder_bias": w["b_dec"]}  # fmt: skip
    save_sae(tmp_path / "ours.safetensors", ours, {"k": str(K), "hook_point": "h"})
    for layout, weights in (
        ("saelens", "sae_weights.safetensors"),
        ("sparsify", "sae.safetensors"),
    ):
        out = export_sae(tmp_path / "ours.safetensors", tmp_path / layout, layout)
        assert sorted(p.name for p in out.iterdir()) == sorted(["cfg.json", weights])
        tensors, info = read_sae(out)
        assert info["layout"] == layout and info["k"] == K
        for name, t in ours.items():
            assert torch.equal(tensors[name], t), (layout, name)
    cfg = json.loads((tmp_path / "saelens" / "cfg.json").read_text())
    assert (
        cfg["architecture"] == "topk" and cfg["d_sae"] == N and cfg["metadata"]["hook_name"] == "h"
    )
    assert safetensors.torch.load_file(tmp_path / "saelens" / "sae_weights.safetensors")[
        "W_enc"
    ].shape == (D, N)


def test_foreign_layouts_that_encode_differently_are_refused(tmp_path):
    w = _random()
    path = saelens_dir(tmp_path / "sl", w)
    cfg = json.loads((path / "cfg.json").read_text())
    (path / "cfg.json").write_text(json.dumps({**cfg, "architecture": "gated"}))
    with pytest.raises(CheckpointError, match="SAELens 'gated' SAE"):
        read_sae(path)
    (path / "cfg.json").write_text(json.dumps({**cfg, "architecture": "standard",
                                               "activation_fn_str": "tanh-relu"}))  # fmt: skip
    with pytest.raises(CheckpointError, match="'standard' SAE with activation 'tanh-relu'"):
        read_sae(path)
    (path / "cfg.json").write_text(json.dumps({**cfg, "architecture": "standard",
                                               "rescale_acts_by_decoder_norm": True}))  # fmt: skip
    with pytest.raises(CheckpointError, match="StandardSAE does not apply"):
        read_sae(path)
    safetensors.torch.save_file({**w, "finetuning_scaling_factor": torch.full((N,), 2.0)},
                                path / "sae_weights.safetensors")  # fmt: skip
    (path / "cfg.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="finetuning_scaling_factor other than 1"):
        read_sae(path)
    safetensors.torch.save_file(w, path / "sae_weights.safetensors")
    (path / "cfg.json").write_text(json.dumps({**cfg, "architecture": "jumprelu"}))
    with pytest.raises(CheckpointError, match="without 'threshold' or 'log_threshold'"):
        read_sae(path)
    (path / "cfg.json").write_text(json.dumps({**cfg, "normalize_activations": "layer_norm"}))
    with pytest.raises(CheckpointError, match="normalize_activations='layer_norm'"):
        read_sae(path)
    sp = sparsify_dir(tmp_path / "sp", w)
    cfg = json.loads((sp / "cfg.json").read_text())
    (sp / "cfg.json").write_text(json.dumps({**cfg, "skip_connection": True}))
    with pytest.raises(CheckpointError, match=r"skip connection .* has no architecture here"):
        read_sae(sp)
    with pytest.raises(CheckpointError, match="not an SAE directory"):
        read_sae(tmp_path)


def saelens_relu_dir(root, w, *, apply_b_dec_to_input=True, old_config=False):
    """A SAELens ReLU ("standard") SAE; ``old_config``: SAELens < 6's cfg.json, which names
    no architecture and gives ``activation_fn_str``."""
    saelens_dir(root, w, apply_b_dec_to_input=apply_b_dec_to_input)
    cfg = json.loads((root / "cfg.json").read_text())
    del cfg["k"]
    if old_config:
        del cfg["architecture"]
        cfg["activation_fn_str"] = "relu"
    else:
        cfg["architecture"] = "standard"
    (root / "cfg.json").write_text(json.dumps(cfg))
    return root


@pytest.mark.parametrize(
    "apply_b_dec_to_input,old_config", [(True, False), (False, False), (True, True)]
)
def test_saelens_relu_sae_encodes_the_same_and_exports_as_jumprelu(
    tmp_path, apply_b_dec_to_input, old_config
):
    w = _random(4)
    path = saelens_relu_dir(tmp_path / "sl", w, apply_b_dec_to_input=apply_b_dec_to_input,
                            old_config=old_config)  # fmt: skip
    tensors, info = read_sae(path)
    assert info["architecture"] == "jumprelu" and info["k"] is None
    assert torch.equal(tensors["threshold"], torch.zeros(N))
    sae = load_sae_model(path)
    x = torch.randn(64, D)
    sae_in = x - w["b_dec"] if apply_b_dec_to_input else x  # SAELens' StandardSAE
    acts = (sae_in @ w["W_enc"] + w["b_enc"]).relu()
    want = acts @ w["W_dec"] + w["b_dec"]
    with torch.no_grad():
        values, indices = sae.encode(x)
        code = torch.zeros(64, N).scatter(1, indices, values)
        torch.testing.assert_close(code, acts, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(sae.decode(values, indices), want, rtol=1e-4, atol=1e-4)
    # exported, it is SAELens' jumprelu at threshold 0: ReLU(pre) * 1[pre > 0] = ReLU(pre)
    out = export_sae(path, tmp_path / "back", "saelens")
    assert json.loads((out / "cfg.json").read_text())["architecture"] == "jumprelu"
    back, _ = read_sae(out)
    for name, t in tensors.items():
        assert torch.equal(back[name], t), name


def test_a_saelens_relu_sae_fine_tunes_as_jumprelu_from_the_initial_threshold(
    tmp_path, activations
):
    g = torch.Generator().manual_seed(5)
    w = {"W_enc": torch.randn(32, 64, generator=g) / 6, "b_enc": torch.zeros(64),
         "W_dec": torch.nn.functional.normalize(torch.randn(64, 32, generator=g), dim=1),
         "b_dec": torch.zeros(32)}  # fmt: skip
    src = saelens_relu_dir(tmp_path / "sl", w)
    config = SAEConfig(dataset=str(activations), init_from=str(src), architecture="jumprelu",
                       n_latents=64, k=4, batch_size=256, tokens=256 * 8,
                       out_dir=str(tmp_path / "run"), checkpoints=0, progress=False, plots=False)  # fmt: skip
    trainer = Trainer(config)
    start = torch.full((64,), config.jumprelu_init_threshold)
    torch.testing.assert_close(trainer.sae.threshold.detach(), start)  # 0 cannot move
    trainer.fit()
    assert torch.isfinite(trainer.sae.log_threshold).all()
    assert not torch.equal(trainer.sae.threshold.detach(), start)  # and it trained


def test_a_sparsify_sae_fine_tunes_and_builds_a_lut(tmp_path, activations):
    from pyspark_safetensors.lut import load_layer_file, precompute_lut

    g = torch.Generator().manual_seed(3)
    w = {"W_enc": torch.randn(32, 64, generator=g) / 6, "b_enc": torch.zeros(64),
         "W_dec": torch.nn.functional.normalize(torch.randn(64, 32, generator=g), dim=1),
         "b_dec": torch.zeros(32)}  # fmt: skip
    src = sparsify_dir(tmp_path / "sp", w)
    config = SAEConfig(dataset=str(activations), init_from=str(src), n_latents=64, k=4,
                       batch_size=256, tokens=256 * 8, out_dir=str(tmp_path / "run"),
                       checkpoints=0, progress=False, plots=False)  # fmt: skip
    trainer = Trainer(config)
    assert torch.equal(trainer.sae.decoder_weight.detach(), w["W_dec"])  # starts from it
    first = trainer.train_step(trainer.loader.batches.read_batch(np.arange(256))["activation"])
    trainer.fit()
    assert trainer.history[-1]["fvu"] < first["fvu"]
    with pytest.raises(ValueError, match="an SAE of 64 latents x 32 inputs; this run has"):
        Trainer(SAEConfig(**{**config.to_dict(), "n_latents": 128, "adam_betas": (0.9, 0.999),
                             "log_to": (), "out_dir": str(tmp_path / "other")}))  # fmt: skip

    # a LUT straight from a foreign directory folds its b_dec like ours
    root, layer = tmp_path / "model", "encoder.layer.0.attention.self.query"
    root.mkdir()
    safetensors.torch.save_file({f"{layer}.weight": torch.randn(12, D)}, root / "model.safetensors")
    d8 = _random()
    precompute_lut(root, {layer: saelens_dir(tmp_path / "sl8", d8)}, progress=False)
    stored = load_layer_file(root / "lut" / f"{layer}.lut.safetensors")
    folded = d8["b_enc"] - d8["W_enc"].T @ d8["b_dec"]
    torch.testing.assert_close(stored["encoder_bias"], folded, rtol=2e-3, atol=2e-3)


def sparsify_transcoder_dir(root, w, w_skip=None):
    """sparsify's transcoder (``transcode=True``; ``skip_connection`` with ``W_skip``),
    as ``SparseCoder.save_to_disk`` writes it: one width ``d_in`` for input and output."""
    sparsify_dir(root, w)
    cfg = json.loads((root / "cfg.json").read_text())
    cfg |= {"transcode": True, "skip_connection": w_skip is not None}
    (root / "cfg.json").write_text(json.dumps(cfg))
    if w_skip is not None:
        tensors = safetensors.torch.load_file(root / "sae.safetensors")
        safetensors.torch.save_file({**tensors, "W_skip": w_skip}, root / "sae.safetensors")
    return root


@pytest.mark.parametrize("skip", [False, True])
def test_sparsify_transcoders_encode_the_same_and_round_trip_exactly(tmp_path, skip):
    """sparsify's forward: top-k of ReLU(encoder(x)) with x uncentred, decoded, plus
    ``x @ W_skip.T``; ours reads it as a (skip) transcoder and writes it back bit for bit."""
    w = _random(6)
    w["W_dec"] = w["W_dec"] * 3  # sparsify's transcoders keep no unit-norm decoder rows
    w_skip = torch.randn(D, D, generator=torch.Generator().manual_seed(7)) if skip else None
    src = sparsify_transcoder_dir(tmp_path / "sp", w, w_skip)
    tensors, info = read_sae(src)
    assert info["architecture"] == ("skip_transcoder" if skip else "transcoder")
    sae = load_sae_model(src)
    x = torch.randn(64, D)
    pre = (x @ w["W_enc"] + w["b_enc"]).relu()  # no b_dec subtracted
    vals, idx = pre.topk(K, dim=1)
    want = torch.zeros_like(pre).scatter(1, idx, vals) @ w["W_dec"] + w["b_dec"]
    if skip:
        want = want + x @ w_skip.T
    with torch.no_grad():
        torch.testing.assert_close(sae(x).x_hat, want, rtol=1e-4, atol=1e-4)
    out = export_sae(src, tmp_path / "back", "sparsify")
    cfg = json.loads((out / "cfg.json").read_text())
    assert (cfg["transcode"], cfg["skip_connection"], cfg["d_in"]) == (True, skip, D)
    assert safetensors.torch.load_file(out / "sae.safetensors").keys() == \
        safetensors.torch.load_file(src / "sae.safetensors").keys()  # fmt: skip
    back, back_info = read_sae(out)
    assert back_info["architecture"] == info["architecture"] and back_info["k"] == K
    assert back.keys() == tensors.keys()
    for name, t in tensors.items():
        assert torch.equal(back[name], t), name
    with pytest.raises(CheckpointError, match="SAELens' transcoders encode with a ReLU"):
        export_sae(src, tmp_path / "sl", "saelens")


def test_transcoders_sparsify_cannot_hold_and_saelens_relu_transcoders_are_refused(tmp_path):
    from pyspark_safetensors.sae.architectures import TranscoderSAE

    narrow = TranscoderSAE(D, N, K, d_out=D // 2)
    save_sae(tmp_path / "t.safetensors", narrow.full_state(), {**narrow.metadata(), "k": str(K)})
    with pytest.raises(CheckpointError, match="one width"):
        export_sae(tmp_path / "t.safetensors", tmp_path / "sp", "sparsify")
    path = saelens_dir(tmp_path / "sl", _random())
    cfg = json.loads((path / "cfg.json").read_text())
    (path / "cfg.json").write_text(json.dumps({**cfg, "architecture": "skip_transcoder"}))
    with pytest.raises(CheckpointError, match="'skip_transcoder', which encodes with a ReLU"):
        read_sae(path)


def _batch_topk_file(path, architecture, threshold, seed=7):
    """A BatchTopK (or Matryoshka) SAE file of ours with random weights and ``threshold``
    recorded as the trainer records it."""
    from pyspark_safetensors.sae import BatchTopKSAE, MatryoshkaSAE

    cls = {"batchtopk": BatchTopKSAE, "matryoshka": MatryoshkaSAE}[architecture]
    sae = cls(D, N, K, seed=seed)
    with torch.no_grad():
        sae.encoder_bias.copy_(0.1 * torch.randn(N, generator=torch.Generator().manual_seed(seed)))
        sae.threshold.fill_(threshold)
    save_sae(path, sae.full_state(), {"k": str(K), **sae.metadata()})
    return path


@pytest.mark.parametrize("architecture", ["batchtopk", "matryoshka"])
def test_batch_topk_saes_go_to_saelens_as_jumprelu_at_their_threshold(tmp_path, architecture):
    """SAELens saves its own BatchTopK and Matryoshka SAEs so: the same code wherever a row
    has at most BATCH_TOPK_ROW_CAP * k pre-activations over the threshold (here every row:
    N = 32 latents, the cap 16, the threshold high enough)."""
    path = _batch_topk_file(tmp_path / "sae.safetensors", architecture, 1.0)
    tensors, info = read_sae(path)
    assert info["architecture"] == architecture and info["threshold"] == 1.0
    ours = load_sae_model(path)
    assert float(ours.threshold) == 1.0
    out = export_sae(path, tmp_path / "saelens", "saelens")
    assert json.loads((out / "cfg.json").read_text())["architecture"] == "jumprelu"
    back, back_info = read_sae(out)
    assert back_info["architecture"] == "jumprelu"
    assert torch.equal(back["threshold"], torch.full((N,), 1.0))
    for name in ("encoder_weight", "encoder_bias", "decoder_weight", "decoder_bias"):
        assert torch.equal(back[name], tensors[name]), name
    x = torch.randn(256, D, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        pre = (x - tensors["decoder_bias"]) @ tensors["encoder_weight"].T + tensors["encoder_bias"]
        assert int((pre > 1.0).sum(1).max()) <= 4 * K  # the cap binds on no row
        want = ours.encode_dense(x)
        assert int((want > 0).sum()) > 256  # latents fire
        torch.testing.assert_close(load_sae_model(out).encode_dense(x), want)
        try:
            from sae_lens import SAE
        except ImportError:
            return
        theirs = SAE.load_from_disk(str(out))
        torch.testing.assert_close(theirs.encode(x), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(theirs.decode(theirs.encode(x)), ours(x).x_hat, rtol=1e-4,
                                   atol=1e-4)  # fmt: skip


def test_a_batch_topk_sae_without_threshold_or_for_sparsify_is_refused(tmp_path):
    untrained = _batch_topk_file(tmp_path / "untrained.safetensors", "batchtopk", 0.0)
    assert read_sae(untrained)[1]["threshold"] == 0.0
    with pytest.raises(CheckpointError, match="without a learned threshold"):
        export_sae(untrained, tmp_path / "a", "saelens")
    trained = _batch_topk_file(tmp_path / "trained.safetensors", "batchtopk", 0.5)
    with pytest.raises(CheckpointError, match="sparsify has no SAE"):
        export_sae(trained, tmp_path / "b", "sparsify")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.parametrize("architecture", ["topk", "jumprelu", "batchtopk", "matryoshka"])
def test_a_dense_encode_is_the_sparse_code_scattered(architecture):
    from pyspark_safetensors.sae import ARCHITECTURES

    sae = ARCHITECTURES[architecture](D, N, K, seed=3).eval()
    if architecture in ("batchtopk", "matryoshka"):
        sae.threshold.fill_(0.2)
    x = torch.randn(64, D, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        dense = sae.encode_dense(x)
        values, indices = sae.encode(x)
        assert dense.shape == (64, N)
        assert torch.equal(dense, torch.zeros(64, N).scatter_add(1, indices, values))
        assert int((dense != 0).sum()) > 64
        torch.testing.assert_close(dense @ sae.decoder_weight + sae.decoder_bias, sae(x).x_hat)
