"""A whole MLP block as a lookup table: a transcoder (and a skip transcoder) of a Llama MLP
block precomputed into ``model.layers.N.mlp.lut.safetensors``, run as ``LUTMLP`` against
the transcoder itself, swapped into a tiny random ``LlamaForCausalLM`` by ``patch_model``,
refused by the readers of linear layers, and evaluated as the MLP's replacement in the
language-model loss of the trained toy Llama."""

import json
import shutil
from dataclasses import replace

import pytest
import torch
from lm_reference import next_token_logps

pytest.importorskip("transformers")

from pyspark_safetensors.lut import (
    LUTMLP,
    LUTLinear,
    evaluate,
    load_layer_file,
    load_lut_layers,
    load_lut_mlps,
    patch_model,
    precompute_lut,
    validate_lut,
)
from pyspark_safetensors.lut.evaluate import lm_batches, lm_loss_evaluation
from pyspark_safetensors.lut.spec import LUTError
from pyspark_safetensors.sae import load_sae_model
from pyspark_safetensors.sae.architectures import get_architecture
from pyspark_safetensors.sae.checkpoint import save_sae

HIDDEN, FF, N_LATENTS, K = 16, 48, 64, 6
BLOCKS = ("model.layers.0.mlp", "model.layers.1.mlp")  # a transcoder, a skip transcoder


def _transcoder(path, d: int, *, skip: bool, seed: int, n: int = N_LATENTS, k: int = K):
    """A random (skip) transcoder ``d -> d`` saved as the trainer saves one, its tensors
    rounded to float16 so that the float16 LUT holds them exactly."""
    arch = "skip_transcoder" if skip else "transcoder"
    sae = get_architecture(arch)(d, n, k, d_out=d)
    gen = torch.Generator().manual_seed(seed)
    state = {name: torch.randn(t.shape, generator=gen) for name, t in sae.full_state().items()}
    state["encoder_weight"] /= d**0.5
    state["decoder_weight"] *= 0.3
    if skip:
        state["skip_weight"] *= 0.1
    state = {name: t.half().float() for name, t in state.items()}
    sae.load_full_state(state)
    save_sae(path, state, {"k": str(k), **sae.metadata(), "hook_point": "mlp:input",
                           "target_hook_point": "mlp:output"})  # fmt: skip
    return path


def _direct(tensors: dict, x: torch.Tensor, k: int) -> torch.Tensor:
    """The contract's maths, densely: ``pre = x W_enc^T + b_enc``, the top k of ReLU(pre),
    ``y = code W_dec + b_dec (+ x W_skip^T)``."""
    pre = x @ tensors["encoder_weight"].T + tensors["encoder_bias"]
    values, indices = pre.relu().topk(k, dim=-1)
    code = torch.zeros_like(pre).scatter(-1, indices, values)
    y = code @ tensors["decoder_weight"] + tensors["decoder_bias"]
    return y + x @ tensors["skip_weight"].T if "skip_weight" in tensors else y


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama saved as a model directory, a transcoder of its layer 0's MLP
    and a skip transcoder of layer 1's, and their LUT."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("lut-mlp")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=HIDDEN, intermediate_size=FF,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=32)  # fmt: skip
    LlamaForCausalLM(config).eval().save_pretrained(root / "llama")
    transcoders = {
        BLOCKS[0]: _transcoder(root / "tc0.safetensors", HIDDEN, skip=False, seed=1),
        BLOCKS[1]: _transcoder(root / "tc1.safetensors", HIDDEN, skip=True, seed=2),
    }
    meta = precompute_lut(root / "llama", transcoders, out_dir=root / "lut", progress=False)
    return root, transcoders, meta


def _llama(root):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(root / "llama").eval()


def test_mlp_lut_files_hold_the_transcoders_in_the_spec_names(tiny):
    root, transcoders, meta = tiny
    lut = root / "lut"
    assert sorted(p.name for p in lut.iterdir()) == sorted(
        ["metadata.json", *(f"{b}.lut.safetensors" for b in BLOCKS)]
    )
    assert validate_lut(lut) == json.loads((lut / "metadata.json").read_text())
    assert meta["sae_config"] == {"num_basis": N_LATENTS, "k_active": K}
    for block, skip in zip(BLOCKS, (False, True), strict=True):
        assert meta["layers"][block] == {"input_dim": HIDDEN, "output_dim": HIDDEN,
                                         "file": f"{block}.lut.safetensors", "kind": "mlp",
                                         "skip": skip}  # fmt: skip
        stored = load_layer_file(lut / f"{block}.lut.safetensors")
        source = load_sae_model(transcoders[block]).full_state()
        names = {"encoder_weight": "encoder_weight", "encoder_bias": "encoder_bias",
                 "precomputed_products": "decoder_weight",
                 "bias_product": "decoder_bias"}  # fmt: skip
        if skip:
            names["skip_weight"] = "skip_weight"
        assert set(stored) == set(names)
        for ours, theirs in names.items():  # float16-representable: stored exactly
            torch.testing.assert_close(stored[ours], source[theirs], rtol=0, atol=0)


@pytest.mark.parametrize("block", BLOCKS, ids=["transcoder", "skip_transcoder"])
def test_lut_mlp_equals_the_transcoder_output_for_output(tiny, block):
    root, transcoders, _ = tiny
    transcoder = load_sae_model(transcoders[block])
    lut = LUTMLP.from_file(root / "lut" / f"{block}.lut.safetensors", K)
    assert (lut.skip_weight is not None) == (block == BLOCKS[1])
    x = torch.randn(3, 7, HIDDEN, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = lut(x)
        judge = transcoder(x.reshape(-1, HIDDEN)).x_hat  # the transcoder's y_hat
        direct = _direct(transcoder.full_state(), x.reshape(-1, HIDDEN), K)
    assert got.shape == x.shape
    torch.testing.assert_close(got.reshape(-1, HIDDEN), judge, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.reshape(-1, HIDDEN), direct, rtol=1e-5, atol=1e-5)
    # the code is sparse: the output is not the skip path (or the bias) alone
    assert float((judge - direct).abs().max()) < 1e-4 < float(judge.abs().max())


def test_patch_model_swaps_each_mlp_block_and_the_logits_equal_a_splice(tiny):
    root, transcoders, _ = tiny
    model, patched = _llama(root), _llama(root)
    assert patch_model(patched, root / "lut") == list(BLOCKS)
    for i in range(2):
        assert isinstance(patched.model.layers[i].mlp, LUTMLP)
        assert not hasattr(patched.model.layers[i].mlp, "gate_proj")
    # the original model with each block's output replaced by its transcoder's
    handles = []
    for block, path in transcoders.items():
        tc = load_sae_model(path)

        def splice(module, args, output, tc=tc):
            x = args[0]
            return tc(x.reshape(-1, HIDDEN)).x_hat.reshape(output.shape)

        handles.append(model.get_submodule(block).register_forward_hook(splice))
    ids = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        spliced = model(ids).logits
        for h in handles:
            h.remove()
        clean = model(ids).logits
        got = patched(ids).logits
    torch.testing.assert_close(got, spliced, rtol=1e-4, atol=1e-4)
    assert float((got - clean).abs().max()) > 1e-2  # the blocks were replaced


def test_readers_of_linear_layers_refuse_an_mlp_block_and_the_reverse(tiny, tmp_path):
    root, transcoders, _ = tiny
    lut = root / "lut"
    file = lut / f"{BLOCKS[0]}.lut.safetensors"
    with pytest.raises(LUTError, match=r"mlp\.lut\.safetensors: an MLP block's LUT.*LUTMLP"):
        LUTLinear.from_file(file, K)
    with pytest.raises(LUTError, match=r"mlp\.lut\.safetensors: 'model\.layers\.0\.mlp' is an "
                                       r"MLP block's LUT.*load_lut_mlps"):  # fmt: skip
        load_lut_layers(lut, [BLOCKS[0]])
    assert load_lut_layers(lut) == {}  # every linear layer: there is none
    with pytest.raises(LUTError, match="use LUTMLP"):
        LUTLinear(load_layer_file(lut / f"{BLOCKS[1]}.lut.safetensors"), K)
    assert set(load_lut_mlps(lut)) == set(BLOCKS)
    with pytest.raises(LUTError, match="evaluate it with lm_loss_evaluation"):
        evaluate(lut, root / "llama", {BLOCKS[0]: torch.randn(2, HIDDEN)})

    # a transcoder keyed by a linear layer, and a linear layer inside a block of the LUT
    with pytest.raises(LUTError, match="replaces a whole MLP block; key it by the block"):
        precompute_lut(root / "llama", {f"{BLOCKS[0]}.down_proj": transcoders[BLOCKS[0]]},
                       out_dir=tmp_path / "a", progress=False)  # fmt: skip
    sae = tmp_path / "sae.safetensors"
    state = load_sae_model(transcoders[BLOCKS[0]]).full_state()
    save_sae(sae, state, {"k": str(K), "architecture": "topk"})
    with pytest.raises(LUTError, match=r"lies inside MLP block 'model\.layers\.0\.mlp'"):
        precompute_lut(root / "llama", {BLOCKS[0]: transcoders[BLOCKS[0]],
                                        f"{BLOCKS[0]}.gate_proj": sae},
                       out_dir=tmp_path / "b", progress=False)  # fmt: skip
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()

    # a linear layer's file read as a block, and a block the model's layers do not fit
    precompute_lut(root / "llama", {f"{BLOCKS[0]}.gate_proj": sae}, out_dir=tmp_path / "lin",
                   progress=False)  # fmt: skip
    with pytest.raises(LUTError, match="a linear layer's LUT, not an MLP block's"):
        LUTMLP.from_file(tmp_path / "lin" / f"{BLOCKS[0]}.gate_proj.lut.safetensors", K)
    with pytest.raises(LUTError, match=r"is a linear layer's LUT.*load_lut_layers"):
        load_lut_mlps(tmp_path / "lin", [f"{BLOCKS[0]}.gate_proj"])
    # metadata.json and the file's header disagree on the kind
    shutil.copytree(lut, tmp_path / "lut")
    meta = json.loads((lut / "metadata.json").read_text())
    meta["layers"][BLOCKS[0]]["kind"] = "linear"
    (tmp_path / "lut" / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(LUTError, match=r"header says kind 'mlp', metadata\.json 'linear'"):
        validate_lut(tmp_path / "lut")


@pytest.fixture(scope="module")
def toy(tmp_path_factory, seed):
    """The tiny toy Llama (trained once per test process, shared with the other tests), a
    skip transcoder of its layer 1's MLP trained by our trainer on the block's input and
    output extracted together, and that block's LUT."""
    import numpy as np

    from pyspark_safetensors.dataset import write_batch_dataset
    from pyspark_safetensors.extract import Extractor, passages_by_key
    from pyspark_safetensors.extract.toy_lm import TINY, toy_lm
    from pyspark_safetensors.sae import SAEConfig
    from pyspark_safetensors.sae.train import Trainer

    model_dir = toy_lm(tmp_path_factory.getbasetemp() / "toy-lm", replace(TINY, seed=seed))
    work = tmp_path_factory.mktemp("lut-mlp-toy")
    hooks = {"in": "model.layers.1.mlp:input", "out": "model.layers.1.mlp:output"}
    windows = Extractor(model_dir, list(hooks.values()), max_length=0, dtype="F32").run(
        passages_by_key(0, 48)
    )
    for name, hook in hooks.items():
        acts = np.concatenate([w.activations[hook] for w in windows])
        write_batch_dataset(work / name, {"activation": acts}, rows_per_shard=4096)
    config = SAEConfig(architecture="skip_transcoder", dataset=str(work / "in"),
                       target_dataset=str(work / "out"), n_latents=128, k=8, batch_size=256,
                       tokens=256 * 60, lr=3e-3, checkpoints=0, out_dir=str(work / "tc"),
                       progress=False, plots=False, seed=seed)  # fmt: skip
    Trainer(config).fit()
    tc = work / "tc" / "sae.safetensors"
    precompute_lut(model_dir, {"model.layers.1.mlp": tc}, out_dir=work / "lut", progress=False)
    return model_dir, tc, work / "lut"


def _hand_ce(model, batches, replace=None):
    """Mean next-token CE and the per-token log-probabilities, layer 1's MLP output
    replaced by ``replace(its input, its output)`` at every real position but BOS."""
    total, count, logps = 0.0, 0, []
    for batch in batches:
        handle = None
        if replace is not None:
            where = batch["attention_mask"].bool().clone()
            where[:, 0] = False

            def post(module, args, out, where=where):
                return torch.where(where[..., None], replace(args[0], out), out)

            handle = model.get_submodule("model.layers.1.mlp").register_forward_hook(post)
        with torch.no_grad():
            logits = model(**batch).logits
        if handle is not None:
            handle.remove()
        ce, n, rows = next_token_logps(logits, batch)
        total, count = total + ce, count + n
        logps += rows
    return total / count, torch.cat(logps)


@pytest.mark.trained
def test_lm_loss_with_the_transcoder_replacing_the_mlp(toy, figure):
    from pyspark_safetensors.extract.model import load_model
    from pyspark_safetensors.extract.toy_lm import TINY, toy_lm_texts

    model_dir, tc_path, lut = toy
    tokenizer, model = load_model(model_dir)
    texts = toy_lm_texts(TINY)[1][:6]
    block = "model.layers.1.mlp"
    report = lm_loss_evaluation(model, tokenizer, texts, transcoders={block: tc_path},
                                lut_dir=[lut], max_length=TINY.context, batch_size=3)  # fmt: skip

    tc = load_sae_model(tc_path)
    batches = lm_batches(tokenizer, texts, max_length=TINY.context, batch_size=3)
    clean, clean_logp = _hand_ce(model, batches)
    spliced, spliced_logp = _hand_ce(
        model, batches, lambda x, out: tc(x.reshape(-1, x.shape[-1])).x_hat.reshape(out.shape)
    )
    zero, _ = _hand_ce(model, batches, lambda x, out: torch.zeros_like(out))
    row = report["mlp"][block]
    assert report["hooks"] == {} and set(report["mlp"]) == {block}
    assert report["ce_clean"] == pytest.approx(clean, rel=1e-5)
    assert row["ce_spliced"] == pytest.approx(spliced, rel=1e-5)
    assert row["ce_zero_ablated"] == pytest.approx(zero, rel=1e-5)
    assert row["ce_loss_recovered"] == pytest.approx(
        (zero - spliced) / (zero - clean), rel=1e-3, abs=1e-4
    )
    kl = float((clean_logp.exp() * (clean_logp - spliced_logp)).sum(-1).mean())
    assert row["kl_spliced"] == pytest.approx(kl, rel=1e-3, abs=1e-7)
    # what a trained transcoder gives: spliced in, the next-token distributions stay far
    # closer to the clean ones than with the block zero-ablated. CE loss recovered is
    # reported, not checked: the tiny toy's block barely matters (zero-ablating it moves the
    # CE by -0.007 to +0.18 nats over seeds 0-4, against a clean 4.4), so the ratio of those
    # differences is noise. Spread (tests/margins.py, seeds 0-4, the pinned CPU path): KL
    # spliced 0.3-1.7 % of zero ablation's (< 20 %, margin +92 %), the LUT's alike
    figure("kl_spliced_over_zero", row["kl_spliced"] / row["kl_zero_ablated"], below=0.2)
    # the block's LUT is the transcoder in float16, run at BOS too: close, not equal
    assert row["ce_lut"] == pytest.approx(row["ce_spliced"], abs=0.01)
    figure("kl_lut_over_zero", row["kl_lut"] / row["kl_zero_ablated"], below=0.2)
    assert report["lut"][0]["ce"] == pytest.approx(row["ce_lut"], rel=1e-6)  # the only entry
    assert set(row) >= {"kl_lut", "ce_loss_recovered_lut", "ce_loss_recovered_mean",
                        "kl_zero_ablated", "kl_mean_ablated"}  # fmt: skip
    for _, module in model.named_modules():
        assert not module._forward_pre_hooks and not module._forward_hooks
    assert type(model.get_submodule(block)).__name__ == "LlamaMLP"

    # a linear layer's LUT inside the block, from another directory: refused together
    state = {n: t for n, t in load_sae_model(tc_path).full_state().items() if n != "skip_weight"}
    save_sae(lut.parent / "sae.safetensors", state, {"k": str(K), "architecture": "topk"})
    precompute_lut(model_dir, {f"{block}.up_proj": lut.parent / "sae.safetensors"},
                   out_dir=lut.parent / "lut-up", progress=False)  # fmt: skip
    with pytest.raises(LUTError, match=r"overlap: layer 'model\.layers\.1\.mlp\.up_proj' lies"):
        lm_loss_evaluation(model, tokenizer, texts[:1], lut_dir=[lut.parent / "lut-up", lut])
    assert type(model.get_submodule(block).up_proj).__name__ == "Linear"


def test_latency_rows_time_the_dense_llama_block_and_count_its_flops(tiny):
    from pyspark_safetensors.lut.latency import DenseMLP, dense_flops, mlp_latency, time_mlp

    root, _, _ = tiny
    llama_mlp = _llama(root).model.layers[0].mlp
    dense = DenseMLP(HIDDEN, FF)
    dense.load_state_dict(llama_mlp.state_dict())  # the same block as transformers' LlamaMLP
    x = torch.randn(5, HIDDEN)
    with torch.no_grad():
        torch.testing.assert_close(dense(x), llama_mlp(x), rtol=1e-6, atol=1e-6)
    assert dense_flops(llama_mlp) == dense_flops(dense) == 2 * 3 * HIDDEN * FF

    block = LUTMLP.from_file(root / "lut" / f"{BLOCKS[1]}.lut.safetensors", K)
    (row,) = time_mlp(block, llama_mlp, (4,), repeat={4: 2})
    assert row["lut_flops"] == 2 * (N_LATENTS * HIDDEN + K * HIDDEN + HIDDEN * HIDDEN)
    assert row["flop_ratio"] == pytest.approx(row["dense_flops"] / row["lut_flops"])
    assert row["lut_s"] > 0 and row["dense_s"] > 0
    assert row["speedup"] == pytest.approx(row["dense_s"] / row["lut_s"])
    rows = mlp_latency(32, 96, 128, 4, (1, 3), skip=True, repeat={1: 2, 3: 2})
    assert [(r["tokens"], r["skip"], r["num_basis"]) for r in rows] == [(1, True, 128),
                                                                       (3, True, 128)]  # fmt: skip


def test_patch_model_refuses_a_block_the_model_does_not_fit(tiny, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    root, _, _ = tiny
    other = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=24, intermediate_size=FF,
                                         num_hidden_layers=2, num_attention_heads=2,
                                         num_key_value_heads=1))  # fmt: skip
    with pytest.raises(LUTError, match=r"model\.layers\.0\.mlp: its layers .* do not read 16"):
        patch_model(other, root / "lut")
    meta = json.loads((root / "lut" / "metadata.json").read_text())
    shutil.copytree(root / "lut", tmp_path / "lut")
    entry = meta["layers"].pop(BLOCKS[0])
    meta["layers"]["model.layers.0.mlp.down_proj"] = entry  # a block's file named for a layer
    (tmp_path / "lut" / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(LUTError, match="is a single Linear; an MLP LUT replaces a whole block"):
        patch_model(_llama(root), tmp_path / "lut")


@pytest.mark.parametrize(
    ("block", "change", "message"),
    [
        (BLOCKS[0], {"skip": None}, r"an MLP block's entry needs 'skip'"),
        (BLOCKS[1], {"skip": False}, r"tensors missing \[\], unexpected \['skip_weight'\]"),
        (BLOCKS[0], {"skip": True}, r"tensors missing \['skip_weight'\], unexpected \[\]"),
        (BLOCKS[0], {"kind": "conv"}, r"kind 'conv'; this reader knows \['linear', 'mlp'\]"),
        (BLOCKS[0], {"output_dim": 8}, r"precomputed_products has shape \[64, 16\], expected"),
    ],
)
def test_validate_lut_checks_the_mlp_kind(tiny, tmp_path, block, change, message):
    root, _, _ = tiny
    shutil.copytree(root / "lut", tmp_path / "lut")
    meta = json.loads((root / "lut" / "metadata.json").read_text())
    for key, value in change.items():
        if value is None:
            del meta["layers"][block][key]
        else:
            meta["layers"][block][key] = value
    (tmp_path / "lut" / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(LUTError, match=message):
        validate_lut(tmp_path / "lut")


def test_a_sparsify_skip_transcoder_makes_the_same_lut(tiny, tmp_path):
    """sparsify's layout of the same skip transcoder (``transcode``, ``skip_connection``)
    gives the same block file, tensor for tensor."""
    from safetensors.torch import load_file

    from pyspark_safetensors.sae.ecosystem import export_sae

    root, transcoders, _ = tiny
    sparsify = export_sae(transcoders[BLOCKS[1]], tmp_path / "sparsify", "sparsify")
    precompute_lut(root / "llama", {BLOCKS[1]: sparsify}, out_dir=tmp_path / "lut",
                   progress=False)  # fmt: skip
    name = f"{BLOCKS[1]}.lut.safetensors"
    ours, theirs = load_file(root / "lut" / name), load_file(tmp_path / "lut" / name)
    assert set(ours) == set(theirs) and "skip_weight" in ours
    for key, tensor in ours.items():
        assert torch.equal(tensor, theirs[key]), key
