"""LUTs for a Llama, named as the LUT specification names them, and the language-model
loss evaluations (clean, SAE spliced, ablated, LUT patched) on the tiny toy Llama trained
here, with SAEs trained by our trainer on its activations."""

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from lm_reference import next_token_logps

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from pyspark_safetensors.dataset import write_batch_dataset
from pyspark_safetensors.extract import Extractor, passages_by_key
from pyspark_safetensors.extract.model import load_model
from pyspark_safetensors.extract.toy_lm import TINY, toy_lm, toy_lm_texts
from pyspark_safetensors.lut import (
    LUTLinear,
    load_layer_file,
    patch_model,
    precompute_lut,
    validate_lut,
)
from pyspark_safetensors.lut.evaluate import evaluate_lm, lm_loss_evaluation
from pyspark_safetensors.lut.inference import dense_lut_reference
from pyspark_safetensors.lut.precompute import model_config
from pyspark_safetensors.sae import SAEConfig, load_sae_model
from pyspark_safetensors.sae.train import Trainer

ATTN_IN = "model.layers.0.self_attn.q_proj:input"
MLP_IN = "model.layers.0.mlp.gate_proj:input"
ATTN = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
MLP = [f"model.layers.0.mlp.{p}_proj" for p in ("gate", "up")]
N_LATENTS, K = 128, 8


@pytest.fixture(scope="module")
def toy(tmp_path_factory, seed):
    """The tiny toy Llama (trained once per test process, shared with the extraction
    tests), an SAE per input (attention, MLP) trained on its activations, and the LUT."""
    root = tmp_path_factory.getbasetemp()
    model_dir = toy_lm(root / "toy-lm", replace(TINY, seed=seed))
    work = tmp_path_factory.mktemp("lut-llama")
    extractor = Extractor(model_dir, [ATTN_IN, MLP_IN], max_length=0, dtype="F32")
    windows = extractor.run(passages_by_key(0, 48))
    saes = {}
    for hook in (ATTN_IN, MLP_IN):
        name = hook.split(".")[3]
        acts = np.concatenate([w.activations[hook] for w in windows])
        write_batch_dataset(work / f"acts-{name}", {"activation": acts}, rows_per_shard=4096)
        config = SAEConfig(dataset=str(work / f"acts-{name}"), n_latents=N_LATENTS, k=K,
                           batch_size=256, tokens=256 * 60, lr=3e-3, checkpoints=0,
                           out_dir=str(work / f"sae-{name}"), progress=False,
                           plots=False, seed=seed)  # fmt: skip
        Trainer(config).fit()
        saes[hook] = work / f"sae-{name}" / "sae.safetensors"
    layers = {**dict.fromkeys(ATTN, saes[ATTN_IN]), **dict.fromkeys(MLP, saes[MLP_IN])}
    meta = precompute_lut(model_dir, layers, out_dir=work / "lut", progress=False)
    return model_dir, saes, work / "lut", meta


def test_model_config_of_gpt2_and_nested_text_configs():
    gpt2 = {"model_type": "gpt2", "n_layer": 12, "n_head": 12, "n_embd": 768}
    assert model_config(gpt2) == {
        "model_type": "gpt2", "num_layers": 12, "num_attention_heads": 12, "hidden_size": 768
    }  # fmt: skip
    nested = {"model_type": "gemma3", "text_config": {"num_hidden_layers": 26,
              "num_attention_heads": 4, "hidden_size": 1152}}  # fmt: skip
    assert model_config(nested) == {
        "model_type": "gemma3", "num_layers": 26, "num_attention_heads": 4, "hidden_size": 1152
    }  # fmt: skip


def test_lut_files_named_and_shaped_as_the_spec(toy):
    _, _, lut, meta = toy
    names = sorted(p.name for p in lut.iterdir())
    assert names == sorted(["metadata.json", *(f"{n}.lut.safetensors" for n in ATTN + MLP)])
    assert validate_lut(lut) == json.loads((lut / "metadata.json").read_text())
    assert meta["model_config"] == {"model_type": "llama", "num_layers": TINY.num_layers,
                                    "num_attention_heads": TINY.num_heads,
                                    "hidden_size": TINY.hidden_size}  # fmt: skip
    assert meta["sae_config"] == {"num_basis": N_LATENTS, "k_active": K}
    head = TINY.hidden_size // TINY.num_heads
    outputs = {ATTN[0]: TINY.hidden_size, ATTN[1]: TINY.num_kv_heads * head,
               ATTN[2]: TINY.num_kv_heads * head, MLP[0]: TINY.intermediate_size,
               MLP[1]: TINY.intermediate_size}  # fmt: skip
    for layer, out_dim in outputs.items():
        entry = meta["layers"][layer]
        assert entry == {"input_dim": TINY.hidden_size, "output_dim": out_dim,
                         "file": f"{layer}.lut.safetensors"}  # fmt: skip
        tensors = load_layer_file(lut / entry["file"])
        assert tuple(tensors["precomputed_products"].shape) == (N_LATENTS, out_dim)
        assert tuple(tensors["encoder_weight"].shape) == (N_LATENTS, TINY.hidden_size)


@pytest.mark.trained
def test_lut_layer_equals_the_dense_layer_within_the_sae_reconstruction_error(toy, figure):
    model_dir, saes, lut, meta = toy
    _, model = load_model(model_dir)
    held_out = toy_lm_texts(TINY)[1]
    extractor = Extractor(model_dir, [ATTN_IN, MLP_IN], max_length=0, dtype="F32")
    windows = extractor.run(held_out)
    for hook, layers in ((ATTN_IN, ATTN), (MLP_IN, MLP)):
        x = torch.from_numpy(np.concatenate([w.activations[hook] for w in windows]))
        sae = load_sae_model(saes[hook])
        with torch.no_grad():
            x_hat = sae(x).x_hat
        for layer in layers:
            weight = model.get_submodule(layer).weight.detach()
            lut_out = LUTLinear.from_file(lut / meta["layers"][layer]["file"], K)(x).detach()
            dense, through_sae = x @ weight.T, x_hat @ weight.T
            # the LUT is the dense layer applied to the SAE's reconstruction, up to its
            # float16 tables (which swap latents that all but tie for the k-th place: an
            # SAE trained this briefly has many)
            rows = (lut_out - through_sae).norm(dim=1) / through_sae.norm(dim=1)
            assert float(rows.median()) < 1e-3
            # so its error against the dense layer is the reconstruction's error
            err_lut = float((lut_out - dense).norm() / dense.norm())
            err_sae = float((through_sae - dense).norm() / dense.norm())
            assert abs(err_lut - err_sae) < 0.05 * err_sae
            # a trained SAE: far from no reconstruction at all
            figure(f"err_sae_{layer}", err_sae, below=0.5)


def _hand_ce(model, batches, replace=None):
    """Mean next-token CE (and the per-token log-probabilities) computed by hand: the q, k,
    v projections' shared input replaced by ``replace`` at every real position but BOS."""
    handles = []
    total, count, logps = 0.0, 0, []
    for batch in batches:
        if replace is not None:
            where = batch["attention_mask"].bool().clone()
            where[:, 0] = False

            def pre(module, args, where=where):
                x = args[0]
                return (torch.where(where[..., None], replace(x), x),)

            handles = [model.get_submodule(n).register_forward_pre_hook(pre) for n in ATTN]
        with torch.no_grad():
            logits = model(**batch).logits
        for h in handles:
            h.remove()
        ce, n, rows = next_token_logps(logits, batch)
        total, count = total + ce, count + n
        logps += rows
    return total / count, torch.cat(logps)


@pytest.mark.trained
def test_ce_loss_recovered_equals_a_hand_computation_and_the_model_is_unchanged(toy, figure):
    model_dir, saes, lut, _ = toy
    tokenizer, model = load_model(model_dir)
    texts = toy_lm_texts(TINY)[1][:12]
    from pyspark_safetensors.lut.evaluate import lm_batches

    batches = lm_batches(tokenizer, texts, max_length=TINY.context, batch_size=4)
    with torch.no_grad():
        before = [model(**b).logits for b in batches]
    modules_before = [(n, type(m)) for n, m in model.named_modules()]

    report = lm_loss_evaluation(model, tokenizer, texts, saes=saes, lut_dir=lut,
                                compensate=(0, 8), max_length=TINY.context, batch_size=4)  # fmt: skip

    sae = load_sae_model(saes[ATTN_IN])
    clean, clean_logp = _hand_ce(model, batches)
    spliced, spliced_logp = _hand_ce(
        model, batches, lambda x: sae(x.reshape(-1, x.shape[-1])).x_hat.reshape(x.shape)
    )
    zero, _ = _hand_ce(model, batches, torch.zeros_like)
    row = report["hooks"][ATTN_IN]
    assert report["tokens"] == clean_logp.shape[0]
    assert report["ce_clean"] == pytest.approx(clean, rel=1e-5)
    assert row["ce_spliced"] == pytest.approx(spliced, rel=1e-5)
    assert row["ce_zero_ablated"] == pytest.approx(zero, rel=1e-5)
    recovered = (zero - spliced) / (zero - clean)
    assert row["ce_loss_recovered"] == pytest.approx(recovered, rel=1e-3, abs=1e-4)
    kl = float((clean_logp.exp() * (clean_logp - spliced_logp)).sum(-1).mean())
    assert row["kl_spliced"] == pytest.approx(kl, rel=1e-3, abs=1e-7)
    # what a trained SAE gives: most of the loss recovered, ablations hurt. Spread
    # (tests/margins.py, seeds 0-4 on the pinned CPU path): CE recovered 0.993-1.011 (> 0.5,
    # margin +98 %); each layer's error through the SAE 0.064-0.211 (< 0.5, the other test,
    # margin +58 %)
    figure("ce_loss_recovered", row["ce_loss_recovered"], above=0.5)
    assert row["ce_zero_ablated"] > row["ce_mean_ablated"] > report["ce_clean"] - 1e-6
    assert set(report["hooks"]) == {ATTN_IN, MLP_IN}
    assert set(report["lut"]) == {0, 8}
    assert report["lut"][8]["kl"] <= report["lut"][0]["kl"] + 1e-6  # compensation helps

    # the model is as it was: no hook left, the LUT layers taken out, the same logits
    assert [(n, type(m)) for n, m in model.named_modules()] == modules_before
    for _, module in model.named_modules():
        assert not module._forward_pre_hooks and not module._forward_hooks
    with torch.no_grad():
        for batch, logits in zip(batches, before, strict=True):
            torch.testing.assert_close(model(**batch).logits, logits, rtol=0, atol=0)


def test_evaluate_lm_loads_the_model_directory(toy):
    model_dir, _, lut, _ = toy
    report = evaluate_lm(model_dir, toy_lm_texts(TINY)[1][:4], lut_dir=lut, batch_size=4)
    assert report["tokens"] > 0 and set(report["lut"]) == {0}
    assert report["lut"][0]["ce"] > 0 and report["hooks"] == {}


def test_gpt2_conv1d_weights_are_read_as_linear_ones(toy, tmp_path):
    """GPT-2 keeps its projections in Conv1D modules (weights ``[in, out]``): the products
    are still ``W_dec @ W_target`` with ``W_target`` the map from input to output."""
    from transformers import GPT2Config, GPT2LMHeadModel

    _, saes, _, _ = toy
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=TINY.hidden_size, n_layer=1,
                        n_head=2)  # fmt: skip
    model = GPT2LMHeadModel(config).eval()
    model.save_pretrained(tmp_path / "gpt2")
    layer = "transformer.h.0.attn.c_attn"
    meta = precompute_lut(tmp_path / "gpt2", {layer: saes[ATTN_IN]}, out_dir=tmp_path / "lut",
                          progress=False)  # fmt: skip
    assert meta["layers"][layer]["output_dim"] == 3 * TINY.hidden_size
    assert meta["model_config"] == {"model_type": "gpt2", "num_layers": 1,
                                    "num_attention_heads": 2,
                                    "hidden_size": TINY.hidden_size}  # fmt: skip
    tensors = load_layer_file(tmp_path / "lut" / f"{layer}.lut.safetensors")
    codes = torch.rand(5, N_LATENTS)  # any code: the products are linear in it
    conv = model.get_submodule(layer)
    with torch.no_grad():
        expected = conv(codes @ tensors["decoder_weight"]) - conv.bias  # x @ weight + bias
    got = codes @ tensors["precomputed_products"]
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-3 * float(expected.abs().max()))
    # patched in place of the Conv1D, its output is the spec's formula plus the layer's bias
    x = torch.randn(2, 5, TINY.hidden_size)
    bias = conv.bias.detach().clone()
    assert patch_model(model, tmp_path / "lut") == [layer]
    lut = model.get_submodule(layer)
    assert isinstance(lut, LUTLinear)
    with torch.no_grad():
        want = dense_lut_reference(tensors, x, K) + bias
        torch.testing.assert_close(lut(x), want, rtol=1e-4, atol=1e-4)
        model(torch.tensor([[1, 2, 3]]))  # the whole model runs with the LUT layer
