"""LUT precompute FLOP/s against the measured matmul peak, and LUTLinear latency and
throughput against the dense layer it approximates (MiniLM layers and a Llama-sized one)."""

from __future__ import annotations

import torch

from pyspark_safetensors.lut import LUTLinear, precompute_layer

from .common import median_seconds, table

# (name, input_dim, output_dim, num_basis, k)
LAYERS = [
    ("MiniLM query 384->384", 384, 384, 16 * 384, 32),
    ("MiniLM intermediate 384->1536", 384, 1536, 16 * 384, 32),
    ("MiniLM output 1536->384", 1536, 384, 16 * 1536, 32),
    ("Llama-sized 4096->14336", 4096, 14336, 16384, 20),
]


def _sae(n: int, d: int) -> dict[str, torch.Tensor]:
    dec = torch.randn(n, d)
    dec /= dec.norm(dim=1, keepdim=True)
    return {"encoder_weight": dec.clone(), "encoder_bias": torch.zeros(n),
            "decoder_weight": dec, "decoder_bias": torch.randn(d) * 0.1}  # fmt: skip


def run() -> str:
    torch.manual_seed(0)
    pre_rows, inf_rows = [], []
    for name, d_in, d_out, n, k in LAYERS:
        weight = torch.randn(d_out, d_in) / d_in**0.5
        sae = _sae(n, d_in)
        a, b = torch.randn(n, d_in), torch.randn(d_in, d_out)
        peak = 2 * n * d_in * d_out / median_seconds(lambda a=a, b=b: a @ b, repeat=3)
        seconds = median_seconds(lambda w=weight, s=sae: precompute_layer(w, s), repeat=3)
        flops = 2 * (n + 1) * d_in * d_out
        pre_rows.append([name, f"{seconds * 1e3:.0f} ms", f"{flops / seconds / 1e9:.1f}",
                         f"{peak / 1e9:.1f}", f"{flops / seconds / peak:.0%}"])  # fmt: skip
        tensors = {k_: v.float() for k_, v in precompute_layer(weight, sae).items()}
        lut = LUTLinear(tensors, k)
        dense = torch.nn.Linear(d_in, d_out, bias=False)
        dense.weight.data = weight
        with torch.inference_mode():
            for batch in (1, 256):
                x = torch.randn(batch, d_in)
                t_lut = median_seconds(lambda x=x, f=lut: f(x), repeat=20 if batch == 1 else 5)
                t_dense = median_seconds(lambda x=x, f=dense: f(x), repeat=20 if batch == 1 else 5)
                inf_rows.append([
                    name, f"n={n}, k={k}", batch,
                    f"{t_lut * 1e6:,.0f} µs", f"{t_dense * 1e6:,.0f} µs",
                    f"{batch / t_lut:,.0f}", f"{t_dense / t_lut:.2f}x",
                ])  # fmt: skip
    return (
        "Precompute (one layer, float32 compute, float16 stored), against the float32 "
        "matmul peak of the same shape measured in the same run:\n\n"
        + table(["layer", "time", "GFLOP/s", "peak GFLOP/s", "share"], pre_rows)
        + "\n\nLUTLinear (float32 tables) against the dense layer, CPU, inference mode:\n\n"
        + table(
            ["layer", "SAE", "batch", "LUT", "dense", "LUT rows/s", "LUT speed vs dense"],
            inf_rows,
        )
        + "\n\nWhy the LUT is slower on CPU: its encoder alone is a dense "
        "[input_dim x num_basis] matmul, larger than the layer it replaces whenever "
        "num_basis > output_dim (16384 vs 14336 for the Llama-sized layer; 16x wider for "
        "MiniLM), and the gather of k table rows adds memory traffic on top. The LUT pays "
        "off only where the encoder is shared by several layers (query, key and value "
        "read one input) or where encoding is cheaper than the dense layer (num_basis < "
        "output_dim, or a sparse/quantised encoder)."
    )
