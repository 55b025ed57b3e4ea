"""One encode per input for the LUT layers that share an SAE: a small Llama-shaped block
whose q, k and v read one input through one SAE, gate and up another, down a third.
The patched block must give what per-layer LUTs give, encode each input once, and never
serve an old result for a new or modified input."""

import pytest
import safetensors.torch
import torch
from torch import nn

from pyspark_safetensors.lut import (
    EncoderGroups,
    LUTError,
    LUTLinear,
    load_layer_file,
    load_lut_layers,
    patch_model,
    precompute_lut,
    validate_lut,
)
from pyspark_safetensors.sae import save_sae

D, HEAD, FF, N, K = 8, 4, 20, 32, 4
PREFIX = "model.layers.0."
Q, KP, V = (PREFIX + f"self_attn.{p}_proj" for p in "qkv")
GATE, UP, DOWN = (PREFIX + f"mlp.{p}_proj" for p in ("gate", "up", "down"))


class Block(nn.Module):
    """q, k, v read the block input; gate and up read the attention's output; down reads
    their product. Only what the test needs of a Llama decoder layer."""

    def __init__(self):
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([nn.Module()])
        layer = self.model.layers[0]
        layer.self_attn = nn.Module()
        attn = layer.self_attn
        attn.q_proj, attn.k_proj, attn.v_proj = (nn.Linear(D, o) for o in (3 * HEAD, HEAD, HEAD))
        attn.o_proj = nn.Linear(HEAD, D)
        layer.mlp = nn.Module()
        mlp = layer.mlp
        mlp.gate_proj, mlp.up_proj = nn.Linear(D, FF), nn.Linear(D, FF)
        mlp.down_proj = nn.Linear(FF, D)

    def forward(self, x):
        attn, mlp = self.model.layers[0].self_attn, self.model.layers[0].mlp
        q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        h = x + attn.o_proj((q[..., :HEAD] * k).softmax(-1) * v)
        return h + mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(h)) * mlp.up_proj(h))


def sae(path, d, seed, tweak=None):
    g = torch.Generator().manual_seed(seed)
    dec = torch.randn(N, d, generator=g)
    dec /= dec.norm(dim=1, keepdim=True)
    enc = dec.clone()
    if tweak is not None:
        enc[tweak] += 0.5  # one encoder row differs, the bias stays the same
    tensors = {"encoder_weight": enc, "encoder_bias": 0.1 * torch.ones(N),
               "decoder_weight": dec, "decoder_bias": 0.1 * torch.randn(d, generator=g)}  # fmt: skip
    save_sae(path, tensors, {"k": str(K)})
    return path


@pytest.fixture
def lut(tmp_path):
    """A model directory and the LUT of its six layers (three SAEs), built here."""
    torch.manual_seed(0)
    block = Block()
    root = tmp_path / "model"
    root.mkdir()
    state = {k: v.detach().contiguous() for k, v in block.state_dict().items()}
    safetensors.torch.save_file(state, root / "model.safetensors")
    attn, mlp, down = (sae(tmp_path / f"{n}.safetensors", d, s)
                       for n, d, s in (("attn", D, 1), ("mlp", D, 2), ("down", FF, 3)))  # fmt: skip
    layers = {Q: attn, KP: attn, V: attn, GATE: mlp, UP: mlp, DOWN: down}
    precompute_lut(root, layers, progress=False)
    return root, block


def per_layer(block, root, compensate=0):
    """The block with each layer replaced by a LUTLinear of its own (no sharing)."""
    meta = validate_lut(root / "lut")
    for name, entry in meta["layers"].items():
        linear = block.get_submodule(name)
        lone = LUTLinear.from_file(root / "lut" / entry["file"], K, bias=linear.bias,
                                   weight=linear.weight, compensate=compensate)  # fmt: skip
        parent, _, child = name.rpartition(".")
        setattr(block.get_submodule(parent), child, lone)
    return block


def encoders(block):
    return {name: block.get_submodule(name).encoder for name in (Q, KP, V, GATE, UP, DOWN)}


@pytest.mark.parametrize("compensate", [0, 3])
def test_shared_encode_gives_what_per_layer_luts_give(lut, compensate):
    import copy

    root, block = lut
    shared, alone = copy.deepcopy(block), per_layer(copy.deepcopy(block), root, compensate)
    assert sorted(patch_model(shared, root / "lut", compensate=compensate)) == sorted(
        encoders(shared)
    )
    enc = encoders(shared)
    assert enc[Q] is enc[KP] is enc[V] and enc[GATE] is enc[UP]
    assert len({id(e) for e in enc.values()}) == 3  # attention, MLP and down: three SAEs
    assert [enc[n].users for n in (Q, GATE, DOWN)] == [3, 2, 1]
    x = torch.randn(2, 5, D)
    with torch.no_grad():
        want, got = alone(x), shared(x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # each input encoded once: q, k and v share one matmul, gate and up another
    assert [enc[n].encodes for n in (Q, GATE, DOWN)] == [1, 1, 1]
    assert sum(e.encodes for e in encoders(alone).values()) == 6
    # the shared model still approximates the exact block (the test is not vacuous)
    assert not torch.equal(got, block(x))


def test_a_new_or_modified_input_is_encoded_afresh(lut):
    root, block = lut
    patch_model(block, root / "lut")
    q, k, v = (block.get_submodule(n) for n in (Q, KP, V))
    ref = {n: LUTLinear.from_file(root / "lut" / f"{n}.lut.safetensors", K,
                                  bias=m.bias) for n, m in ((Q, q), (KP, k), (V, v))}  # fmt: skip
    enc = q.encoder
    with torch.inference_mode():  # inference tensors keep no version counter
        x = torch.randn(6, D)
        torch.testing.assert_close(q(x), ref[Q](x), rtol=0, atol=0)
        torch.testing.assert_close(k(x), ref[KP](x), rtol=0, atol=0)
        assert enc.encodes == 1
        x.mul_(-2.0)  # the same tensor, modified in place
        torch.testing.assert_close(v(x), ref[V](x), rtol=0, atol=0)
        assert enc.encodes == 2
        y = torch.randn(6, D)  # another input of the same shape
        torch.testing.assert_close(q(y), ref[Q](y), rtol=0, atol=0)
        del x, y
        z = torch.empty(6, D).uniform_(-3, 3)  # may land in a freed tensor's memory
        torch.testing.assert_close(k(z), ref[KP](z), rtol=0, atol=0)
        torch.testing.assert_close(v(z[:3]), ref[V](z[:3]), rtol=0, atol=0)  # other shape
        assert enc.encodes == 5
        # an equal input, another tensor: equal content is what counts
        torch.testing.assert_close(q(z[:3].clone()), ref[Q](z[:3]), rtol=0, atol=0)
        assert enc.encodes == 5


def test_inputs_that_need_a_gradient_are_encoded_per_layer(lut):
    root, block = lut
    patch_model(block, root / "lut")
    q, k = block.get_submodule(Q), block.get_submodule(KP)
    x = torch.randn(4, D, requires_grad=True)
    (q(x).sum() + 2 * k(x).sum()).backward()
    assert q.encoder.encodes == 2
    lone = {n: LUTLinear.from_file(root / "lut" / f"{n}.lut.safetensors", K, bias=m.bias)
            for n, m in ((Q, q), (KP, k))}  # fmt: skip
    x2 = x.detach().clone().requires_grad_(True)
    (lone[Q](x2).sum() + 2 * lone[KP](x2).sum()).backward()
    assert x.grad.abs().sum() > 0
    torch.testing.assert_close(x.grad, x2.grad, rtol=0, atol=0)


def test_a_layer_alone_keeps_no_copy_of_its_input(lut):
    root, _ = lut
    lone = LUTLinear.from_file(root / "lut" / f"{DOWN}.lut.safetensors", K)
    with torch.no_grad():
        x = torch.randn(3, FF)
        lone(x), lone(x)
    assert lone.encoder.users == 1 and lone.encoder.encodes == 2 and lone.encoder._last is None


def test_layers_with_other_encoders_are_not_grouped(tmp_path, lut):
    root, _ = lut
    one = load_layer_file(root / "lut" / f"{Q}.lut.safetensors")
    groups = EncoderGroups(K)
    first = groups.encoder(one)
    assert groups.encoder({k: v.clone() for k, v in one.items()}) is first
    other_row = dict(one, encoder_weight=one["encoder_weight"].clone())
    other_row["encoder_weight"][5, 2] += 1e-3  # equal bias, one weight differs
    other_bias = dict(one, encoder_bias=one["encoder_bias"] + 1e-3)
    assert groups.encoder(other_row) is not first
    assert groups.encoder(other_bias) is not first
    assert groups.encoder(other_row) is not groups.encoder(other_bias)
    assert len(groups) == 3
    with pytest.raises(LUTError, match="not this layer's"):
        LUTLinear(other_row, K, encoder=first)
    with pytest.raises(LUTError, match="not this layer's"):
        LUTLinear(one, K - 1, encoder=first)

    # two SAEs that differ in one encoder row, for q and k: two encoders, two encodes
    model_root = tmp_path / "model2"
    model_root.mkdir()
    (model_root / "model.safetensors").write_bytes((root / "model.safetensors").read_bytes())
    a, b = sae(tmp_path / "a.safetensors", D, 1), sae(tmp_path / "b.safetensors", D, 1, tweak=7)
    precompute_lut(model_root, {Q: a, KP: b, V: a}, progress=False)
    luts = load_lut_layers(model_root / "lut")
    assert luts[Q].encoder is luts[V].encoder is not luts[KP].encoder
    x = torch.randn(5, D)
    with torch.no_grad():
        for name in (Q, KP, V):
            luts[name](x)
    assert luts[Q].encoder.encodes == 1 and luts[KP].encoder.encodes == 1
