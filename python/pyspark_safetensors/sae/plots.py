"""End-of-training plots (rank 0): loss, FVU and dead latents over tokens, and the
histogram of latent firing frequencies."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


def plot_training(
    history: list[dict], fire_count: torch.Tensor, tokens: int, out_dir: str | Path
) -> list[Path]:
    """Write ``training.png`` and ``latent_frequency.png`` into ``out_dir``."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never open a window
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    written = []
    if history:
        t = [h["tokens"] for h in history]
        fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
        for ax, key, label in zip(
            axes,
            ("loss", "fvu", "dead_fraction"),
            ("loss (FVU + aux)", "FVU", "dead latents"),
            strict=True,
        ):
            values = [h[key] * (100 if key == "dead_fraction" else 1) for h in history]
            ax.plot(t, values)
            ax.set_xlabel("tokens")
            ax.set_title(label + (" (%)" if key == "dead_fraction" else ""))
            if key != "dead_fraction" and min(values) > 0:
                ax.set_yscale("log")
            ax.grid(alpha=0.3)
        fig.tight_layout()
        written.append(out_dir / "training.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    freq = fire_count.double().numpy() / max(tokens, 1)
    fig, ax = plt.subplots(figsize=(6, 3.6))
    alive = freq[freq > 0]
    if alive.size:
        ax.hist(np.log10(alive), bins=50)
    ax.set_xlabel("log10 firing frequency")
    ax.set_ylabel("latents")
    ax.set_title(f"latent frequency ({int((freq == 0).sum())} never fired)")
    fig.tight_layout()
    written.append(out_dir / "latent_frequency.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)
    return written
