"""How long an MLP block takes as a LUT (``LUTMLP``) against the dense block it replaces,
with the FLOPs of each beside the times, on this machine.

    rows = mlp_latency()                     # Llama-3-8B's block, random weights, CPU
    rows = time_mlp(lut, model.model.layers[0].mlp, tokens=(1, 512))   # a real block

FLOPs are 2 x multiply-adds per token: the dense block's linear layers (Llama's gate, up
and down: ``3 d_model d_ff``; the activation and the product are left out); the LUT's
encode (``num_basis d_in``), its k gathered rows (``k d_out``) and a skip transcoder's
``d_out d_in`` (the top-k over ``num_basis`` values is left out).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from .inference import LUTMLP

LLAMA3_8B = {"d_model": 4096, "d_ff": 14336}
"""Llama-3-8B's MLP block: hidden 4096, intermediate 14336."""
REPEAT = {1: 15, 512: 3}
"""Timed calls per token count (after one warm-up); other counts get 5."""


class DenseMLP(nn.Module):
    """Llama's MLP block, ``down(silu(gate(x)) * up(x))``, without bias (as
    ``transformers``' ``LlamaMLP``)."""

    def __init__(self, d_model: int, d_ff: int, *, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, d_ff, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(d_model, d_ff, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(d_ff, d_model, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def dense_flops(block: nn.Module) -> int:
    """FLOPs per token of ``block``'s linear layers (``nn.Linear`` and GPT-2's ``Conv1D``)."""
    total = 0
    for module in block.modules():
        if isinstance(module, nn.Linear):
            total += 2 * module.in_features * module.out_features
        elif type(module).__name__ == "Conv1D":
            total += 2 * module.weight.numel()
    return total


def lut_flops(lut: LUTMLP) -> int:
    """FLOPs per token of a ``LUTMLP``: the encode, k rows, the skip path."""
    num_basis = lut.encoder.weight.shape[0]
    total = 2 * num_basis * lut.in_features + 2 * lut.k_active * lut.out_features
    if lut.skip_weight is not None:
        total += 2 * lut.in_features * lut.out_features
    return total


@torch.inference_mode()
def time_mlp(
    lut: LUTMLP,
    dense: nn.Module,
    tokens: tuple[int, ...] = (1, 512),
    *,
    repeat: dict[int, int] | None = None,
    seed: int = 0,
) -> list[dict]:
    """Per token count: median seconds of ``lut`` and of ``dense`` (the block it replaces,
    e.g. a model's ``model.layers.0.mlp``) on the same random inputs, called in turn so
    that a shared machine's drifts touch both alike; every call meets a new input. Rows
    ``{tokens, lut_s, dense_s, speedup (dense_s / lut_s), lut_flops, dense_flops,
    flop_ratio (dense / LUT)}``, FLOPs per token."""
    repeat = {**REPEAT, **(repeat or {})}
    dtype = lut.encoder.weight.dtype
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for n in tokens:
        inputs = [torch.randn(n, lut.in_features, generator=gen, dtype=dtype) for _ in range(2)]
        times: dict[str, list[float]] = {"lut": [], "dense": []}
        for i in range(repeat.get(n, 5) + 1):  # the first round warms up
            for name, fn in (("lut", lut), ("dense", dense)):
                x = inputs[i % 2]
                start = time.perf_counter()
                fn(x)
                if i:
                    times[name].append(time.perf_counter() - start)
        lut_s, dense_s = (statistics.median(times[k]) for k in ("lut", "dense"))
        rows.append({
            "tokens": n, "lut_s": lut_s, "dense_s": dense_s, "speedup": dense_s / lut_s,
            "lut_flops": lut_flops(lut), "dense_flops": dense_flops(dense),
            "flop_ratio": dense_flops(dense) / lut_flops(lut),
        })  # fmt: skip
    return rows


def random_lut_mlp(
    d_model: int,
    num_basis: int,
    k: int,
    *,
    skip: bool = False,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> LUTMLP:
    """A ``LUTMLP`` ``d_model -> d_model`` with random tables (latency does not depend on
    the values)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.empty(*shape, dtype=dtype).uniform_(-1, 1, generator=gen)

    tensors = {
        "encoder_weight": rand(num_basis, d_model) / d_model**0.5,
        "encoder_bias": rand(num_basis) * 0.01,
        "precomputed_products": rand(num_basis, d_model),
        "bias_product": rand(d_model),
    }
    if skip:
        tensors["skip_weight"] = rand(d_model, d_model) / d_model**0.5
    return LUTMLP(tensors, k, dtype=dtype)


def mlp_latency(
    d_model: int = LLAMA3_8B["d_model"],
    d_ff: int = LLAMA3_8B["d_ff"],
    num_basis: int = 32768,
    k: int = 32,
    tokens: tuple[int, ...] = (1, 512),
    *,
    skip: bool = False,
    dtype: torch.dtype = torch.float32,
    repeat: dict[int, int] | None = None,
) -> list[dict]:
    """``time_mlp`` of a random ``LUTMLP`` (``num_basis`` latents, top ``k``, a skip path
    when ``skip``) against a random dense Llama block (``DenseMLP``), by default at
    Llama-3-8B's shapes; each row adds ``d_model``, ``d_ff``, ``num_basis``, ``k``,
    ``skip`` and ``dtype``. Memory: the dense block's three weights (705 MB in float32 at
    Llama-3-8B's shapes) and the LUT's two ``num_basis x d_model`` tables (1.07 GB at
    32,768 latents), built one after the other and freed on return."""
    torch.manual_seed(0)
    dense = DenseMLP(d_model, d_ff, dtype=dtype).eval()
    lut = random_lut_mlp(d_model, num_basis, k, skip=skip, dtype=dtype)
    rows = time_mlp(lut, dense, tokens, repeat=repeat)
    shape = {"d_model": d_model, "d_ff": d_ff, "num_basis": num_basis, "k": k, "skip": skip,
             "dtype": str(dtype).removeprefix("torch.")}  # fmt: skip
    return [{**shape, **row} for row in rows]
