"""End-of-training plots (rank 0): FVU, L0, dead latents, learning rate and gradient
norm over tokens (held-out points beside the training ones, and the held-out FVU of each
Matryoshka prefix or crosscoder hook point), and the histogram of latent firing
frequencies."""

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
        panels = [  # (metric key, title, log scale, scale)
            ("fvu", "FVU (reconstruction)", True, 1),
            ("l0", "L0 (active latents per token)", False, 1),
            ("dead_fraction", "dead latents (%)", False, 100),
            ("lr", "learning rate", False, 1),
            ("grad_norm", "gradient norm (before clipping)", True, 1),
        ]
        panels = [p for p in panels if any(p[0] in h for h in history)]
        fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.3))
        for ax, (key, title, log, scale) in zip(np.atleast_1d(axes), panels, strict=True):
            values = [h[key] * scale for h in history if key in h]
            # a line alone draws nothing for a single logged point (a run shorter than
            # log_every): few points are marked
            style = "o-" if len(values) <= 30 else "-"
            ax.plot([h["tokens"] for h in history if key in h], values, style, markersize=3,
                    label="train")  # fmt: skip
            held = [(h["tokens"], h["val_" + key] * scale) for h in history if "val_" + key in h]
            if held:
                ax.plot(*zip(*held, strict=True), "o-", markersize=3, label="held-out")
                values += [v for _, v in held]
            if key == "fvu":  # a Matryoshka SAE's prefixes, a crosscoder's hook points
                for part in _parts(history):
                    points = [(h["tokens"], h[part]) for h in history if part in h]
                    ax.plot(*zip(*points, strict=True), ".--", markersize=3, linewidth=0.8,
                            label=part[len("val_fvu_"):])  # fmt: skip
                    values += [v for _, v in points]
            if held:
                ax.legend(fontsize=6, frameon=False)
            if log and min(values) > 0:
                ax.set_yscale("log")
            elif key == "dead_fraction":  # a flat zero line on a +-0.04 axis says nothing
                ax.set_ylim(0, max(5.0, 1.15 * max(values)))
            ax.set_title(title, fontsize=9)
            ax.set_xlabel("tokens")
            ax.ticklabel_format(axis="x", style="sci", scilimits=(0, 0))
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


def _parts(history: list[dict]) -> list[str]:
    """The ``val_fvu_<part>`` keys of the log, in first-seen order."""
    return list(dict.fromkeys(k for h in history for k in h if k.startswith("val_fvu_")))
