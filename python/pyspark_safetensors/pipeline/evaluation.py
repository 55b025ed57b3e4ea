"""The pipeline's held-out evaluation: texts no stage has seen, through the model once;
each SAE's reconstruction of its hook point, each LUT layer against the exact layer, each
hook point's LUT layers (one shared encode) timed against its dense layers; then what the
model itself gives: a causal LM's next-token loss with each SAE spliced in, each hook point
ablated and every LUT layer patched in (``lut.evaluate_lm``), an encoder's sentence
embeddings with its LUT layers patched in."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

RARE_FREQUENCY = 1e-4
"""Marked on the frequency plot: latents firing less often than this are nearly dead."""


def sae_figures(sae_path: Path, x: torch.Tensor) -> tuple[dict, np.ndarray]:
    """Held-out FVU, L0, dead (never firing) and dense latents of the SAE at ``sae_path``
    on ``x [N, d]`` with the trainer's encoding, and each latent's firing frequency."""
    from ..sae import load_sae_model
    from ..sae.evaluate import evaluate_sae

    sae = load_sae_model(sae_path)
    figures = evaluate_sae(sae, x.float().split(4096))
    freq = figures.pop("frequency")
    return {**figures, "k": sae.k, "num_latents": sae.n_latents}, freq


def lut_latency(
    luts: Mapping[str, torch.nn.Module],
    weights: Mapping[str, torch.Tensor],
    x: torch.Tensor,
    repeat: int = 7,
) -> dict:
    """Median seconds of one hook point's LUT layers (``luts``, float32; those that share
    an encoder encode each input once, as in a patched model) and of the dense layers they
    replace (``x @ W.T`` for each of ``weights``), on the same inputs, on this machine."""
    weights = {name: w.float() for name, w in weights.items()}
    # two inputs in turn, so every timed call meets a new input and encodes it
    inputs = (x, x + 1)

    def median(fn) -> float:
        fn(inputs[1])  # warm-up
        times = []
        for i in range(repeat):
            start = time.perf_counter()
            fn(inputs[i % 2])
            times.append(time.perf_counter() - start)
        return float(np.median(times))

    with torch.no_grad():
        lut_s = median(lambda x: [f(x) for f in luts.values()])
        dense_s = median(lambda x: [x @ w.T for w in weights.values()])
    return {
        "layers": list(luts),
        "encodes": len({id(f.encoder) for f in luts.values()}),
        "tokens": len(x),
        "lut_ms": lut_s * 1e3,
        "dense_ms": dense_s * 1e3,
        "lut_over_dense": lut_s / dense_s,
    }


def plot_frequencies(freqs: Mapping[str, np.ndarray], tokens: int, out: Path) -> Path:
    """Histogram of held-out latent firing frequencies per SAE, with the rare threshold."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    # one firing in the whole held-out set is the smallest frequency that can show; bins of
    # a quarter decade keep the few-firings counts (1/N, 2/N, ...) from leaving gaps
    lowest = min(np.log10(RARE_FREQUENCY), -np.log10(max(tokens, 1))) - 0.25
    bins = np.arange(np.floor(lowest * 4) / 4, 0.25, 0.25)
    for hook, freq in freqs.items():
        never = int((freq == 0).sum())
        ax.hist(np.log10(freq[freq > 0]), bins=bins, histtype="step", linewidth=1.5,
                label=f"{hook} ({never} never fired)")  # fmt: skip
    ax.axvline(np.log10(RARE_FREQUENCY), color="grey", linestyle="--", label="rare threshold 1e-4")
    ax.set_xlabel("log10 firing frequency on held-out tokens")
    ax.set_ylabel("latents")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=1, frameon=False)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def evaluate_pipeline(
    *,
    model_dir: str | os.PathLike,
    hooks: Mapping[str, Sequence[str]],
    sae_files: Mapping[str, Path],
    lut_dir: Path,
    texts: Sequence[str],
    max_length: int,
    ks: Sequence[int],
    ms: Sequence[int],
    out_dir: Path,
) -> dict:
    """Every held-out figure of the report, on ``texts``: ``lm_loss`` for a causal LM,
    ``embedding_cosine`` otherwise; writes ``evaluation.md``/``evaluation.png`` (LUT error
    against k) and ``latent_frequency.png`` into ``out_dir``."""
    from ..extract import Extractor
    from ..extract.model import is_causal_lm
    from ..lut import embedding_agreement, evaluate, load_lut_layers
    from ..lut.evaluate import evaluate_lm
    from ..lut.precompute import ModelWeights
    from ..lut.spec import validate_lut

    texts = list(texts)
    extractor = Extractor(model_dir, list(hooks), max_length=max_length)
    windows = extractor.run(texts)
    acts = {
        hook: torch.cat([torch.from_numpy(w.activations[hook].astype(np.float32)) for w in windows])
        for hook in hooks
    }
    saes, freqs = {}, {}
    for hook, path in sae_files.items():
        saes[hook], freqs[hook] = sae_figures(path, acts[hook])
    plot_frequencies(freqs, min(len(x) for x in acts.values()), out_dir / "latent_frequency.png")

    k_active = validate_lut(lut_dir)["sae_config"]["k_active"]
    layer_inputs = {layer: acts[hook] for hook, layers in hooks.items() for layer in layers}
    rows = evaluate(
        lut_dir, model_dir, layer_inputs, ks=list(ks) or None, ms=list(ms), out_dir=out_dir
    )
    weights = ModelWeights(model_dir)
    latency = {  # per hook point: what a patched model runs for that input
        hook: lut_latency(
            load_lut_layers(lut_dir, list(layers), k_active=k_active),
            {layer: weights.weight(layer) for layer in layers},
            acts[hook],
        )
        for hook, layers in hooks.items()
    }
    figures = {
        "held_out_texts": len(texts),
        "held_out_tokens": {hook: len(x) for hook, x in acts.items()},
        "sae": saes,
        "lut": rows,
        "k_active": k_active,
        "latency": latency,
    }
    if is_causal_lm(model_dir):
        # the extractor's length: max_length 0 resolved to the model's context
        lm = evaluate_lm(
            model_dir, texts, saes=dict(sae_files), lut_dir=lut_dir, compensate=list(ms),
            max_length=extractor.max_length,
        )  # fmt: skip
        figures["lm_loss"] = {**lm, "lut": {str(m): v for m, v in lm["lut"].items()}}
    else:
        figures["embedding_cosine"] = {
            str(m): embedding_agreement(
                model_dir, lut_dir, texts, compensate=m, max_length=max_length
            )
            for m in ms
        }
    return figures
