"""End-of-training plots (rank 0): loss, FVU and dead latents over tokens, and the
histogram of latent firing frequencies."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


def plot_training(
    history: list[dict],
    fire_count: torch.Tensor,
    tokens: int,
    out_dir: str | Path,
    val_frequency: np.ndarray | None = None,
) -> list[Path]:
    """Write ``training.png`` (with the held-out points when ``history`` has ``val_*``
    keys) and ``latent_frequency.png`` (training and, when given, held-out frequencies)
    into ``out_dir``."""
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
            ax.plot(t, values, label="train")
            held = [(h["tokens"], h["val_" + key]) for h in history if "val_" + key in h]
            if held:
                scale = 100 if key == "dead_fraction" else 1
                ax.plot([a for a, _ in held], [b * scale for _, b in held], "o-",
                        label="held-out")  # fmt: skip
                ax.legend(fontsize=7)
                values += [b * scale for _, b in held]
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
    title = f"latent frequency ({int((freq == 0).sum())} never fired in training"
    for name, f in (("train", freq), ("held-out", val_frequency)):
        if f is None:
            continue
        alive = f[f > 0]
        if alive.size:
            ax.hist(np.log10(alive), bins=50, alpha=0.6, label=name)
    if val_frequency is not None:
        title += f", {int((val_frequency == 0).sum())} on held-out"
        ax.legend(fontsize=7)
    ax.set_xlabel("log10 firing frequency")
    ax.set_ylabel("latents")
    ax.set_title(title + ")", fontsize=9)
    fig.tight_layout()
    written.append(out_dir / "latent_frequency.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)
    return written
