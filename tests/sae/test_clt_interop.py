"""Cross-layer transcoders in circuit-tracer's and sparsify's layouts: written from ours
and read back bit for bit, read from files those libraries' own code wrote, loaded by
their own loaders with the same outputs (when installed, e.g. in a venv of baselines:
``.venv-baselines/bin/python -m pytest tests/sae/test_clt_interop.py``), and malformed
files refused naming the tensor and the shape expected."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
import torch

from pyspark_safetensors.sae import (
    CheckpointError,
    CrossLayerTranscoder,
    export_sae,
    load_sae_model,
    read_sae,
    save_sae,
)

L, D, N, K, B = 3, 12, 32, 3, 40
HAS_CT = importlib.util.find_spec("circuit_tracer") is not None


def _has_sparsify_clt() -> bool:
    """sparsify's cross-layer code (its runner module), not imported here: the import
    picks the decoder kernel by the environment."""
    spec = importlib.util.find_spec("sparsify")
    places = (spec and spec.submodule_search_locations) or []
    return any((Path(place) / "runner.py").is_file() for place in places)


def _clt_file(tmp_path, *, tied=False, diagonal=False, seed=5):
    """Our CLT file with every tensor moved off its initial value (no term is 0)."""
    clt = CrossLayerTranscoder(D, N, K, d_out=D, n_layers=L, tied_decoders=tied,
                               hook_points=[f"model.layers.{i}.mlp:input" for i in range(L)])  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    state = {n: t + 0.3 * torch.randn(t.shape, generator=gen) for n, t in clt.full_state().items()}
    state["threshold"] = state["threshold"].abs()
    if diagonal:
        for layer in range(L):
            state[f"decoder_weight.{layer}"][:, 1:] = 0
    path = tmp_path / "clt.safetensors"
    save_sae(path, state, clt.metadata())
    return path, state


def _xs(seed=7, rows=B):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, D, generator=gen) + 0.5 for _ in range(L)]


def _untied(state):
    return {n: t.expand(-1, L - int(n.split(".")[1]), -1) if n.startswith("decoder_weight.")
            else t for n, t in state.items()}  # fmt: skip


@pytest.mark.parametrize("layout", ["circuit-tracer", "sparsify"])
@pytest.mark.parametrize("tied", [False, True])
def test_export_then_read_is_bit_exact(tmp_path, layout, tied):
    path, state = _clt_file(tmp_path, tied=tied)
    out = export_sae(path, tmp_path / layout, layout)
    tensors, info = read_sae(out)
    assert info["layout"] == layout and info["architecture"] == "clt"
    want = _untied(state)
    if layout == "sparsify":  # sparsify has no thresholds: it keeps the top k
        want["threshold"] = torch.zeros(L, N)
        assert info["k"] == K
    assert sorted(tensors) == sorted(want)
    for name, t in want.items():
        assert torch.equal(tensors[name], t), name
    blocks = json.loads(info["metadata"]["blocks"])
    assert blocks == [f"model.layers.{i}.mlp" for i in range(L)]
    ours, back = load_sae_model(path), load_sae_model(out, k=K)
    xs = _xs()
    for y, z in zip(ours.forward_layers(xs), back.forward_layers(xs), strict=True):
        assert torch.equal(y, z)


def test_a_per_layer_set_round_trips_and_a_clt_is_not_one(tmp_path):
    path, state = _clt_file(tmp_path, diagonal=True)
    out = export_sae(path, tmp_path / "set", "circuit-tracer-transcoders")
    assert sorted(p.name for p in out.iterdir()) == [
        "config.yaml", "layer_0.safetensors", "layer_1.safetensors", "layer_2.safetensors"]  # fmt: skip
    tensors, info = read_sae(out)
    assert info["layout"] == "circuit-tracer-transcoders"
    for name, t in state.items():
        assert torch.equal(tensors[name], t), name
    path, _ = _clt_file(tmp_path)
    with pytest.raises(CheckpointError, match=r"slot 1 \(layer 0 -> 1\) is not zero"):
        export_sae(path, tmp_path / "set2", "circuit-tracer-transcoders")
    assert not (tmp_path / "set2").exists()


def test_malformed_files_are_refused_naming_the_tensor_and_the_shape(tmp_path):
    path, _ = _clt_file(tmp_path)
    ct = export_sae(path, tmp_path / "ct", "circuit-tracer")
    safetensors.numpy.save_file({"W_dec_1": np.zeros((N, L, D), np.float32)},
                                ct / "W_dec_1.safetensors")  # fmt: skip
    with pytest.raises(CheckpointError, match=r"W_dec_1 has shape \[32, 3, 12\], "
                       r"expected \[32, 2, 12\]"):  # fmt: skip
        read_sae(ct)
    ct = export_sae(path, tmp_path / "ct", "circuit-tracer")  # whole again
    raw = safetensors.numpy.load_file(ct / "W_enc_2.safetensors")
    del raw["b_enc_2"]
    safetensors.numpy.save_file(raw, ct / "W_enc_2.safetensors")
    with pytest.raises(CheckpointError, match=r"missing tensor b_enc_2 \(expected shape \[32\]\)"):
        read_sae(ct)
    sp = export_sae(path, tmp_path / "sp", "sparsify")
    layer1 = sp / "model.layers.1.mlp" / "sae.safetensors"
    raw = safetensors.numpy.load_file(layer1)
    raw["post_encs.1"] = np.full(N, 0.1, np.float32)
    safetensors.numpy.save_file(raw, layer1)
    with pytest.raises(CheckpointError, match=r"post_encs.1 is not zero"):
        read_sae(sp)
    raw["post_encs.1"], raw["W_decs.0"] = np.zeros(N, np.float32), np.zeros((N, D + 1), np.float32)
    safetensors.numpy.save_file(raw, layer1)
    with pytest.raises(
        CheckpointError, match=r"W_decs.0 has shape \[32, 13\], expected \[32, 12\]"
    ):
        read_sae(sp)
    cfg = sp / "model.layers.0.mlp" / "cfg.json"
    cfg.write_text(json.dumps(dict(json.loads(cfg.read_text()), divide_cross_layer=True)))
    with pytest.raises(CheckpointError, match="divide_cross_layer = True"):
        read_sae(sp)
    with pytest.raises(CheckpointError, match="records no k"):
        load_sae_model(_no_k(tmp_path, path))


def _no_k(tmp_path, path):
    """A circuit-tracer CLT without our config.yaml: no k anywhere."""
    out = export_sae(path, tmp_path / "bare", "circuit-tracer")
    (out / "config.yaml").unlink()
    return out


def test_wider_outputs_have_no_circuit_tracer_layout(tmp_path):
    clt = CrossLayerTranscoder(D, N, K, d_out=D + 2, n_layers=L)
    save_sae(tmp_path / "w.safetensors", clt.full_state(), clt.metadata())
    with pytest.raises(CheckpointError, match=r"from 12 to 14 dimensions"):
        export_sae(tmp_path / "w.safetensors", tmp_path / "ct", "circuit-tracer")


# --- the libraries' own code ------------------------------------------------------------------


@pytest.mark.skipif(not HAS_CT, reason="circuit-tracer is not installed (optional baseline)")
@pytest.mark.parametrize("lazy", [False, True])
def test_circuit_tracer_loads_our_clt_with_the_same_outputs(tmp_path, lazy):
    from circuit_tracer.transcoder.cross_layer_transcoder import load_clt

    path, _ = _clt_file(tmp_path)
    out = export_sae(path, tmp_path / "ct", "circuit-tracer")
    theirs = load_clt(str(out), device=torch.device("cpu"), dtype=torch.float32,
                      lazy_decoder=lazy, lazy_encoder=lazy)  # fmt: skip
    ours, xs = load_sae_model(path), _xs()
    for layer in range(L):  # their JumpReLU is our threshold rule
        torch.testing.assert_close(theirs.encode_layer(xs[layer], layer),
                                   ours.encode_layer(layer, xs[layer], rule="threshold"))  # fmt: skip
    codes = theirs.encode(torch.stack(xs))  # [L, B, n]
    assert int((codes > 0).sum()) > 0
    torch.testing.assert_close(theirs.decode(codes),
                               torch.stack(ours.forward_layers(xs, rule="threshold")),
                               rtol=1e-5, atol=1e-5)  # fmt: skip


@pytest.mark.skipif(not HAS_CT, reason="circuit-tracer is not installed (optional baseline)")
def test_we_read_what_circuit_tracer_writes(tmp_path):
    from circuit_tracer.transcoder.activation_functions import JumpReLU
    from circuit_tracer.transcoder.cross_layer_transcoder import CrossLayerTranscoder as CT
    from circuit_tracer.transcoder.single_layer_transcoder import (
        SingleLayerTranscoder,
        TranscoderSet,
        load_transcoder_set,
    )

    torch.manual_seed(0)
    theirs = CT(L, N, D, activation_function="jump_relu", lazy_decoder=False,
                device=torch.device("cpu"), dtype=torch.float32)  # fmt: skip
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        theirs.activation_function.threshold.abs_()
    theirs.to_safetensors(str(tmp_path / "ct"))
    ours, xs = load_sae_model(tmp_path / "ct", k=K), _xs()
    torch.testing.assert_close(torch.stack(ours.forward_layers(xs, rule="threshold")),
                               theirs.decode(theirs.encode(torch.stack(xs))),
                               rtol=1e-5, atol=1e-5)  # fmt: skip
    plts = {}
    for layer in range(L):
        t = SingleLayerTranscoder(D, N, JumpReLU(torch.rand(N), 0.1), layer,
                                  device=torch.device("cpu"), dtype=torch.float32)  # fmt: skip
        with torch.no_grad():
            for p in (t.W_enc, t.W_dec, t.b_enc, t.b_dec):
                p.copy_(torch.randn_like(p) * 0.3)
        plts[layer] = t
    TranscoderSet(plts, "mlp.hook_in", "mlp.hook_out").to_safetensors(str(tmp_path / "set"))
    ours = load_sae_model(tmp_path / "set", k=K)
    codes = [ours.encode_layer(layer, xs[layer], rule="threshold") for layer in range(L)]
    for layer in range(L):
        torch.testing.assert_close(ours.decode_layer(layer, codes), plts[layer](xs[layer]),
                                   rtol=1e-5, atol=1e-5)  # fmt: skip
    back = export_sae(tmp_path / "set", tmp_path / "set2", "circuit-tracer-transcoders", k=K)
    paths = {layer: str(back / f"layer_{layer}.safetensors") for layer in range(L)}
    loaded = load_transcoder_set(paths, "ours", "mlp.hook_in", "mlp.hook_out",
                                 device=torch.device("cpu"))  # fmt: skip
    for layer in range(L):
        torch.testing.assert_close(loaded[layer](xs[layer]), plts[layer](xs[layer]))


@pytest.mark.skipif(not _has_sparsify_clt(), reason="sparsify with cross_layer is not installed")
def test_sparsify_runs_our_clt_with_the_same_outputs(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSIFY_DISABLE_TRITON", "1")  # its eager decoder on a CPU
    from sparsify import CrossLayerRunner, SparseCoder

    monkeypatch.setattr(torch._dynamo.config, "disable", True)  # its encode is torch.compile'd
    path, _ = _clt_file(tmp_path)
    out = export_sae(path, tmp_path / "sp", "sparsify")
    blocks = [f"model.layers.{i}.mlp" for i in range(L)]
    coders = {b: SparseCoder.load_from_disk(out / b) for b in blocks}
    ours, xs = load_sae_model(path), _xs()
    runner, want = CrossLayerRunner(), ours.forward_layers(xs)
    with torch.no_grad():
        for t, block in enumerate(blocks):
            got = runner(xs[t], want[t], coders[block], block)
            torch.testing.assert_close(got.sae_out, want[t], rtol=1e-5, atol=1e-5)
            assert float(got.fvu) < 1e-8
    tensors, _ = read_sae(out)  # and what sparsify saves reads back as ours
    for b in blocks:
        coders[b].save_to_disk(tmp_path / "again" / b)
    again, _ = read_sae(tmp_path / "again")
    for name, t in tensors.items():
        assert torch.equal(again[name], t), name
