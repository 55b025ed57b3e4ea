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


def sae_figures(
    sae_path: Path, x: torch.Tensor, y: torch.Tensor | None = None
) -> tuple[dict, np.ndarray]:
    """Held-out FVU (of ``y`` for a transcoder, else of ``x``; and of each part an
    architecture reports: a crosscoder's hook points, a Matryoshka SAE's prefixes), L0,
    dead (never firing) and dense latents of the SAE at ``sae_path`` on ``x [N, d]`` with
    the trainer's encoding, and each latent's firing frequency."""
    from ..sae import load_sae_model
    from ..sae.evaluate import evaluate_sae

    sae = load_sae_model(sae_path)
    xs = x.float().split(4096)
    figures = evaluate_sae(
        sae, xs if y is None else list(zip(xs, y.float().split(4096), strict=True))
    )
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


def family_figures(
    acts: Mapping[str, torch.Tensor],
    transcoders: Mapping[str, tuple[str, str, Path]],
    crosscoders: Mapping[str, tuple[Sequence[str], Path]],
    saes: Mapping[str, dict],
) -> tuple[dict, dict, dict[str, np.ndarray]]:
    """Held-out figures of each transcoder (``{block: (input hook, target hook, file)}``:
    the FVU of its target) and crosscoder (``{name: (hook points, file)}``: the FVU of all
    of them and of each, beside each hook point's own SAE's FVU where it has one), and their
    latents' firing frequencies by name."""
    freqs: dict[str, np.ndarray] = {}
    out_transcoders, out_crosscoders = {}, {}
    for block, (source, target, path) in transcoders.items():
        figures, freqs[block] = sae_figures(path, acts[source], acts[target])
        out_transcoders[block] = {**figures, "input": source, "target": target}
    for name, (hooks, path) in crosscoders.items():
        figures, freqs[name] = sae_figures(path, torch.cat([acts[h] for h in hooks], dim=1))
        out_crosscoders[name] = {
            **figures,
            "hooks": list(hooks),
            "sae_fvu": {h: saes[h]["fvu"] for h in hooks if h in saes},
            "sae_latents": {h: saes[h]["num_latents"] for h in hooks if h in saes},
        }
    return out_transcoders, out_crosscoders, freqs


def mlp_lut_latency(model, lut_dir: Path, tokens: Sequence[int] = (1, 512)) -> dict:
    """Per MLP block of ``lut_dir``: ``lut.latency.time_mlp`` of its LUT against the
    model's own block (rows per token count: seconds, FLOPs per token, their ratios)."""
    from ..lut import load_lut_mlps
    from ..lut.latency import time_mlp

    luts = load_lut_mlps(lut_dir)
    modules = dict(model.named_modules())
    return {block: time_mlp(lut, modules[block], tuple(tokens)) for block, lut in luts.items()}


def held_out_activations(
    model_dir: str | os.PathLike,
    hook_points: Sequence[str],
    texts: Sequence[str],
    max_length: int,
):
    """The model's activations at each of ``hook_points`` on ``texts`` (float32, every
    window's tokens concatenated: ``{hook: [N, d]}``) and the extractor that made them
    (its model and resolved ``max_length`` are reused)."""
    from ..extract import Extractor

    hook_points = list(dict.fromkeys(hook_points))
    extractor = Extractor(model_dir, hook_points, max_length=max_length)
    windows = extractor.run(list(texts))
    acts = {
        hook: torch.cat([torch.from_numpy(w.activations[hook].astype(np.float32)) for w in windows])
        for hook in hook_points
    }
    return extractor, acts


def lut_figures(
    *,
    model_dir: str | os.PathLike,
    hooks: Mapping[str, Sequence[str]],
    lut_dir: Path,
    acts: Mapping[str, torch.Tensor],
    ks: Sequence[int],
    ms: Sequence[int],
    out_dir: Path,
) -> dict:
    """The LUT's ``k_active``, each LUT layer against the exact layer on its hook point's
    held-out inputs (``lut.evaluate``: its rows, writing ``evaluation.md``/``.png`` into
    ``out_dir``) and each hook point's LUT layers timed against its dense layers
    (``lut_latency``)."""
    from ..lut import evaluate, load_lut_layers
    from ..lut.precompute import ModelWeights
    from ..lut.spec import validate_lut

    k_active = validate_lut(lut_dir)["sae_config"]["k_active"]
    layer_inputs = {layer: acts[hook] for hook, layers in hooks.items() for layer in layers}
    rows = (
        evaluate(lut_dir, model_dir, layer_inputs, ks=list(ks) or None, ms=list(ms), out_dir=out_dir)
        if layer_inputs else []
    )  # fmt: skip
    weights = ModelWeights(model_dir)
    latency = {  # per hook point: what a patched model runs for that input
        hook: lut_latency(
            load_lut_layers(lut_dir, list(layers), k_active=k_active),
            {layer: weights.weight(layer) for layer in layers},
            acts[hook],
        )
        for hook, layers in hooks.items()
    }
    return {"lut": rows, "k_active": k_active, "latency": latency}


def model_figures(
    *,
    model_dir: str | os.PathLike,
    sae_files: Mapping[str, Path],
    lut_dir: Path,
    texts: Sequence[str],
    ms: Sequence[int],
    max_length: int,
    resolved_max_length: int,
    transcoders: Mapping[str, tuple[str, str, Path]],
) -> dict:
    """What the model itself gives with the SAEs and LUTs in place: a causal LM's
    ``lm_loss`` (``lut.evaluate_lm``, over windows of ``resolved_max_length``, the
    extractor's), else an encoder's ``embedding_cosine`` per compensation ``m`` (over
    ``max_length`` as given)."""
    from ..extract.model import is_causal_lm
    from ..lut import embedding_agreement
    from ..lut.evaluate import evaluate_lm

    if is_causal_lm(model_dir):
        lm = evaluate_lm(
            model_dir, texts, saes=dict(sae_files), lut_dir=lut_dir, compensate=list(ms),
            max_length=resolved_max_length,
            transcoders={block: path for block, (_, _, path) in transcoders.items()},
        )  # fmt: skip
        return {"lm_loss": {**lm, "lut": {str(m): v for m, v in lm["lut"].items()}}}
    return {
        "embedding_cosine": {
            str(m): embedding_agreement(
                model_dir, lut_dir, texts, compensate=m, max_length=max_length
            )
            for m in ms
        }
    }


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
    transcoders: Mapping[str, tuple[str, str, Path]] | None = None,
    crosscoders: Mapping[str, tuple[Sequence[str], Path]] | None = None,
    llama3_8b_latency: bool = False,
) -> dict:
    """Every held-out figure of the report, on ``texts``: each SAE's, transcoder's and
    crosscoder's (``family_figures``), each LUT layer's and MLP block's, ``lm_loss`` for a
    causal LM (a transcoder replacing its whole block among them), ``embedding_cosine``
    otherwise; with ``llama3_8b_latency`` an MLP LUT's latency at Llama-3-8B's shapes
    (``lut.latency.mlp_latency``: 1.8 GB of random tables). Writes
    ``evaluation.md``/``evaluation.png`` (LUT error against k) and ``latent_frequency.png``
    into ``out_dir``."""
    from ..lut.latency import mlp_latency

    transcoders, crosscoders = dict(transcoders or {}), dict(crosscoders or {})
    texts = list(texts)
    needed = [*hooks, *(h for t in transcoders.values() for h in t[:2]),
              *(h for hs, _ in crosscoders.values() for h in hs)]  # fmt: skip
    extractor, acts = held_out_activations(model_dir, needed, texts, max_length)
    saes, freqs = {}, {}
    for hook, path in sae_files.items():
        saes[hook], freqs[hook] = sae_figures(path, acts[hook])
    families = family_figures(acts, transcoders, crosscoders, saes)
    freqs.update(families[2])
    plot_frequencies(freqs, min(len(x) for x in acts.values()), out_dir / "latent_frequency.png")
    luts = lut_figures(model_dir=model_dir, hooks=hooks, lut_dir=lut_dir, acts=acts, ks=ks,
                       ms=ms, out_dir=out_dir)  # fmt: skip
    figures = {
        "held_out_texts": len(texts),
        "held_out_tokens": {hook: len(x) for hook, x in acts.items()},
        "sae": saes,
        "transcoders": families[0],
        "crosscoders": families[1],
        **luts,
    }
    if transcoders:
        figures["mlp_latency"] = mlp_lut_latency(extractor.model, lut_dir)
    if transcoders and llama3_8b_latency:
        figures["mlp_latency_llama3_8b"] = mlp_latency()
    # the extractor's length: max_length 0 resolved to the model's context
    return figures | model_figures(
        model_dir=model_dir, sae_files=sae_files, lut_dir=lut_dir, texts=texts, ms=ms,
        max_length=max_length, resolved_max_length=extractor.max_length,
        transcoders=transcoders,
    )  # fmt: skip
