"""LUT precompute FLOP/s against the measured matmul peak; LUTLinear latency against the
dense layer it approximates, one layer alone (MiniLM's) and, at Llama-3-8B's shapes, a
hook point's layers with one shared encode (gate+up; q,k,v) against those dense layers,
with where the LUT's time goes; and a whole MLP block as a transcoder's LUT (``LUTMLP``)
against the dense block (gate, up, act, down) at Llama-3-8B's shapes
(``lut.latency.mlp_latency``)."""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from pyspark_safetensors.lut import LUTEncoder, LUTLinear, precompute_layer
from pyspark_safetensors.lut.latency import LLAMA3_8B, mlp_latency

from .common import interleaved_medians, median_seconds, table

# (name, input_dim, output_dim, num_basis, k)
LAYERS = [
    ("MiniLM query 384->384", 384, 384, 16 * 384, 32),
    ("MiniLM intermediate 384->1536", 384, 1536, 16 * 384, 32),
    ("MiniLM output 1536->384", 1536, 384, 16 * 1536, 32),
    ("Llama-sized 4096->14336", 4096, 14336, 16384, 20),
]
# Llama-3-8B: hidden 4096, MLP 14336, 32 query heads and 8 key/value heads of 128 (GQA);
# the LUT spec's SAE: 16,384 basis vectors, k = 20
D_IN, N_BASIS, K = 4096, 16384, 20
HOOK_SETS = [
    ("gate+up 4096->14336 x2", (14336, 14336)),
    ("q,k,v GQA 4096->4096,1024,1024", (4096, 1024, 1024)),
    ("q,k,v MHA 4096->4096 x3", (4096, 4096, 4096)),
    ("gate alone 4096->14336", (14336,)),
]
BATCHES = (1, 16, 512)  # decoding steps of 1 and 16 sequences; a 512-token prefill
REPEAT = {1: 15, 16: 9, 512: 3}


def _sae(n: int, d: int) -> dict[str, torch.Tensor]:
    dec = torch.randn(n, d)
    dec /= dec.norm(dim=1, keepdim=True)
    return {"encoder_weight": dec.clone(), "encoder_bias": torch.zeros(n),
            "decoder_weight": dec, "decoder_bias": torch.randn(d) * 0.1}  # fmt: skip


def _precompute_and_single_layers() -> tuple[list, list]:
    pre_rows, inf_rows = [], []
    for name, d_in, d_out, n, k in LAYERS:
        weight = torch.randn(d_out, d_in) / d_in**0.5
        sae = _sae(n, d_in)
        a, b = torch.randn(n, d_in), torch.randn(d_in, d_out)
        big = d_in * d_out * n > 1e11  # the Llama-sized one: ~10 s a matmul, timed once
        repeat, warmup = (1, 0) if big else (3, 1)
        peak = 2 * n * d_in * d_out / median_seconds(lambda a=a, b=b: a @ b, repeat, warmup)
        del a, b
        seconds = median_seconds(lambda w=weight, s=sae: precompute_layer(w, s), repeat, warmup)
        flops = 2 * (n + 1) * d_in * d_out
        pre_rows.append([name, f"{seconds * 1e3:.0f} ms", f"{flops / seconds / 1e9:.1f}",
                         f"{peak / 1e9:.1f}", f"{flops / seconds / peak:.0%}"])  # fmt: skip
        if big:  # its inference is measured below, with the shared encode
            continue
        tensors = {k_: v.float() for k_, v in precompute_layer(weight, sae).items()}
        lut = LUTLinear(tensors, k)
        dense = torch.nn.Linear(d_in, d_out, bias=False)
        dense.weight.data = weight
        with torch.inference_mode():
            for batch in (1, 256):
                x = torch.randn(batch, d_in)
                cases = {"lut": lambda x=x, f=lut: f(x), "dense": lambda x=x, f=dense: f(x)}
                t = interleaved_medians(cases, repeat=15 if batch == 1 else 5)
                inf_rows.append([
                    name, f"n={n}, k={k}", batch,
                    f"{t['lut'] * 1e6:,.0f} µs", f"{t['dense'] * 1e6:,.0f} µs",
                    f"{t['dense'] / t['lut']:.2f}x",
                ])  # fmt: skip
    return pre_rows, inf_rows


def _flops(outs: tuple[int, ...]) -> tuple[float, float]:
    """Multiply-adds x 2 per token: (LUT: one encode and k rows per layer, dense)."""
    return 2 * N_BASIS * D_IN + sum(2 * K * o for o in outs), sum(2 * D_IN * o for o in outs)


def _shared_encode(
    dtype: torch.dtype, sets: list, batches: tuple[int, ...] = BATCHES, label: str = ""
) -> tuple[list, list]:
    """Per hook set of ``sets`` and batch: the LUT layers sharing one encoder against the dense layers;
    and for gate+up, the LUT's time split into its steps."""
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.empty(*shape, dtype=dtype).uniform_(-1, 1, generator=gen)

    enc_w, enc_b = rand(N_BASIS, D_IN) / D_IN**0.5, rand(N_BASIS) * 0.01
    products = {o: rand(N_BASIS, o) for o in {o for _, outs in sets for o in outs}}
    rows, split = [], []
    with torch.inference_mode():
        for name, outs in sets:
            encoder = LUTEncoder(enc_w, enc_b, K)
            luts = [
                LUTLinear({"encoder_weight": enc_w, "encoder_bias": enc_b,
                           "precomputed_products": products[o], "bias_product": rand(o)},
                          K, dtype=dtype, encoder=encoder)
                for o in outs
            ]  # fmt: skip
            dense = []
            for o in outs:
                layer = torch.nn.Linear(D_IN, o, bias=False, dtype=dtype)
                layer.weight.data = rand(o, D_IN) / D_IN**0.5
                dense.append(layer)
            lut_flops, dense_flops = _flops(outs)
            for batch in batches:
                # two inputs in turn: every call meets a new input, as a model's next step
                # would, so the first layer always encodes and the others reuse it
                xs = itertools.cycle([rand(batch, D_IN), rand(batch, D_IN)])
                x_dense = itertools.cycle([rand(batch, D_IN), rand(batch, D_IN)])
                before = encoder.encodes
                t = interleaved_medians({
                    "lut": lambda xs=xs, luts=luts: [f(x) for x in [next(xs)] for f in luts],
                    "dense": lambda xs=x_dense, d=dense: [f(x) for x in [next(xs)] for f in d],
                }, repeat=REPEAT[batch])  # fmt: skip
                calls = encoder.encodes - before
                assert calls == REPEAT[batch] + 1, "the shared encode must run once per call"
                rows.append([
                    name + label, str(dtype).removeprefix("torch."), batch,
                    f"{t['lut'] * 1e3:,.2f}", f"{t['dense'] * 1e3:,.2f}",
                    f"**{t['dense'] / t['lut']:.2f}x**", f"{dense_flops / lut_flops:.2f}x",
                ])  # fmt: skip
                if name.startswith("gate+up") and not label:
                    split.append([str(dtype).removeprefix("torch."), batch,
                                  *_steps(luts, rand(batch, D_IN), REPEAT[batch]),
                                  f"{t['dense'] * 1e3:,.2f}"])  # fmt: skip
            del luts, dense, encoder
    return rows, split


def _steps(luts: list[LUTLinear], x: torch.Tensor, repeat: int) -> list[str]:
    """Milliseconds of the encoder matmul, ReLU + top-k, and the gathers of every layer."""
    enc = luts[0].encoder
    pre = F.linear(x, enc.weight, enc.bias)
    values, indices = pre.relu().topk(K, dim=-1, sorted=False)
    t_mm = median_seconds(lambda: F.linear(x, enc.weight, enc.bias), repeat)
    t_top = median_seconds(lambda: pre.relu().topk(K, dim=-1, sorted=False), repeat)
    t_gather = median_seconds(
        lambda: [
            F.embedding_bag(indices, f.precomputed_products, per_sample_weights=values,
                            mode="sum") + f.bias_product
            for f in luts
        ],
        repeat,
    )  # fmt: skip
    share = t_mm / (t_mm + t_top + t_gather)
    return [f"{s * 1e3:,.2f}" for s in (t_mm, t_top, t_gather)] + [f"{share:.0%}"]


# (num_basis, k, skip) of the MLP-block LUTs: a transcoder of 8x d_model, its skip
# variant, and the LUT spec's 16,384 basis vectors
MLP_LUTS = [(32768, 32, False), (32768, 32, True), (16384, 32, False)]
HEADER_MLP = ["LUT latents", "tokens", "LUT ms", "dense ms", "LUT speed vs dense",
              "LUT MFLOP/token", "dense MFLOP/token", "FLOP ratio"]  # fmt: skip


def mlp_block_section() -> str:
    """The MLP-block table: ``LUTMLP`` against the dense Llama-3-8B block, float32."""
    rows = []
    for num_basis, k, skip in MLP_LUTS:
        for r in mlp_latency(num_basis=num_basis, k=k, skip=skip):
            rows.append([
                f"{num_basis:,}, k {k}" + (", skip" if skip else ""), r["tokens"],
                f"{r['lut_s'] * 1e3:,.1f}", f"{r['dense_s'] * 1e3:,.1f}",
                f"**{r['speedup']:.2f}x**", f"{r['lut_flops'] / 1e6:,.1f}",
                f"{r['dense_flops'] / 1e6:,.1f}", f"{r['flop_ratio']:.2f}x",
            ])  # fmt: skip
    return (
        f"A whole MLP block at Llama-3-8B's shapes (d_model {LLAMA3_8B['d_model']}, d_ff "
        f"{LLAMA3_8B['d_ff']}): a transcoder's LUT (`LUTMLP`: encode, top-k, k rows of the "
        "table, the skip path) against the dense block (gate, up, SiLU, down), random "
        "weights, float32, every call a new input, the two in turn. MFLOP per token: the "
        "linear maps only (2 x multiply-adds):\n\n" + table(HEADER_MLP, rows)
    )


def run() -> str:
    import os

    torch.manual_seed(0)
    load = " ".join(f"{v:.2f}" for v in os.getloadavg())
    pre_rows, inf_rows = _precompute_and_single_layers()
    shared_rows, split_rows = [], []
    # bfloat16 for the two sets of a Llama block only: it keeps the run short
    for dtype, sets in ((torch.float32, HOOK_SETS), (torch.bfloat16, HOOK_SETS[:2])):
        rows, split = _shared_encode(dtype, sets)
        shared_rows += rows
        split_rows += split
    # On a shared machine a step split over both threads can wait a scheduler slice for
    # the other one; one thread shows the small batches without that wait.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for dtype in (torch.float32, torch.bfloat16):
            shared_rows += _shared_encode(dtype, HOOK_SETS[:1], (1, 16), " (1 thread)")[0]
    finally:
        torch.set_num_threads(threads)
    mlp = mlp_block_section()
    load_after = " ".join(f"{v:.2f}" for v in os.getloadavg())
    ratios = [f"{d / lut:.2f}x" for lut, d in (_flops(outs) for _, outs in HOOK_SETS)]
    return (
        "Precompute (one layer, float32 compute, float16 stored), against the float32 "
        "matmul peak of the same shape measured in the same run (the Llama-sized layer "
        "timed once):\n\n"
        + table(["layer", "time", "GFLOP/s", "peak GFLOP/s", "share"], pre_rows)
        + "\n\nOne LUTLinear alone (float32 tables) against the dense layer, CPU, inference "
        "mode (above 1x the LUT is faster):\n\n"
        + table(["layer", "SAE", "batch", "LUT", "dense", "LUT speed vs dense"], inf_rows)
        + f"\n\nA hook point's layers at Llama-3-8B's shapes (input {D_IN}, num_basis "
        f"{N_BASIS}, k {K}), the LUT layers sharing one encoder (one encode per input) "
        "against the dense `nn.Linear` layers, both in the dtype given, measured in turn in "
        "one run; every call gets a new input. FLOP ratio: dense multiply-adds over the "
        f"LUT's (one encode, {N_BASIS}x{D_IN}, plus k rows per layer) per token:\n\n"
        + table(
            ["layers", "dtype", "tokens", "LUT ms", "dense ms", "LUT speed vs dense", "FLOP ratio"],
            shared_rows,
        )
        + "\n\nWhere the gate+up LUT's time goes (each step timed alone; gathers: both "
        "layers' `embedding_bag` of k rows plus `bias_product`):\n\n"
        + table(
            [
                "dtype",
                "tokens",
                "encoder matmul ms",
                "ReLU + top-k ms",
                "gathers ms",
                "matmul share",
                "dense gate+up ms",
            ],
            split_rows,
        )
        + "\n\n"
        + mlp
        + f"\n\nPer token the LUT costs one encode ({N_BASIS} x {D_IN} multiply-adds, and "
        "as many encoder weights read when decoding is memory-bound) however many layers "
        f"share it, plus k rows per layer. Dense over LUT FLOPs: gate+up {ratios[0]}, "
        f"q,k,v GQA {ratios[1]}, q,k,v MHA {ratios[2]}, one layer alone {ratios[3]}: a LUT "
        "can win only where num_basis x input_dim is below the summed input_dim x output_dim "
        "of the layers sharing the encode. Load average (1, 5, 15 min) before: "
        f"{load}; after: {load_after}."
    )
