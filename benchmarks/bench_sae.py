"""SAE training step: tokens/s and achieved FLOP/s against the measured matmul peak, and
the sparse path against a dense-decoder reference of the same SAE (same loss)."""

from __future__ import annotations

import torch

from pyspark_safetensors.sae import TopKSAE, dense_reference

from .common import median_seconds, table

CASES = [(384, 16 * 384, 32, 4096), (1024, 16 * 1024, 32, 4096)]


def _step(sae, opt, x, dense: bool) -> float:
    opt.zero_grad(set_to_none=True)
    x_hat = dense_reference(sae, x) if dense else sae(x).x_hat
    loss = (x_hat - x).pow(2).sum() / x.shape[0]
    loss.backward()
    sae.before_update()
    opt.step()
    sae.after_update()
    return float(loss.detach())


def run() -> str:
    torch.manual_seed(0)
    rows = []
    for d, n, k, batch in CASES:
        x = torch.randn(batch, d)
        w = torch.randn(n, d)
        peak = 2 * batch * n * d / median_seconds(lambda x=x, w=w: x @ w.T, repeat=5)
        times, losses = {}, {}
        for dense in (False, True):
            sae = TopKSAE(d, n, k, seed=0)
            opt = torch.optim.Adam(sae.parameters(), lr=1e-4)
            times[dense] = median_seconds(
                lambda s=sae, o=opt, dn=dense, x=x: _step(s, o, x, dn), repeat=3
            )
            fresh = TopKSAE(d, n, k, seed=0)
            losses[dense] = _step(fresh, torch.optim.Adam(fresh.parameters(), lr=1e-4), x, dense)
        # Useful work of the sparse step: the dense encoder matmul, and O(B k d) for the
        # decoder, its backward and the encoder's sparse backward.
        flops = 2 * batch * n * d + 8 * batch * k * d
        rows.append([
            f"d={d}, n={n}, k={k}, B={batch}",
            f"{batch / times[False]:,.0f}",
            f"{flops / times[False] / 1e9:.1f} ({flops / times[False] / peak:.0%} of {peak / 1e9:.1f})",
            f"{times[False] * 1e3:.0f} ms",
            f"{times[True] * 1e3:.0f} ms",
            f"{times[True] / times[False]:.2f}x",
            f"{abs(losses[True] - losses[False]) / losses[True]:.1e}",
        ])  # fmt: skip
    return (
        "SAE training step on CPU (float32; forward, backward, Adam, decoder renorm). "
        "GFLOP/s counts the sparse step's useful work against the float32 matmul peak "
        "measured in the same run ([B, d] @ [d, n]).\n\n"
        + table(
            [
                "case",
                "tokens/s",
                "GFLOP/s (share of peak)",
                "sparse step",
                "dense step",
                "speed-up",
                "loss rel. diff",
            ],
            rows,
        )
    )
