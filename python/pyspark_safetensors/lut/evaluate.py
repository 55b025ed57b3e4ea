"""How good a LUT is: per layer, on held-out activations, the relative L2 error and the
cosine similarity of the LUT output against the exact ``x @ W_target``, for several k and
compensation sizes m; and end to end, how close a patched model's embeddings stay."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
import torch.nn.functional as F

from .inference import LUTLinear, load_layer_file, patch_model
from .precompute import ModelWeights
from .spec import validate_lut


@torch.no_grad()
def evaluate_layer(
    tensors: dict[str, torch.Tensor],
    weight: torch.Tensor,
    x: torch.Tensor,
    *,
    ks: Iterable[int],
    ms: Iterable[int] = (0, 8, 32),
) -> list[dict]:
    """Rows ``{k, m, rel_l2, cosine}`` comparing the LUT (without any layer bias) with
    ``x @ weight.T`` on ``x [N, input_dim]``."""
    x = x.to(torch.float32)
    exact = x @ weight.to(torch.float32).T
    rows = []
    for k in ks:
        for m in ms:
            lut = LUTLinear(tensors, k, weight=weight if m else None, compensate=m)
            out = lut(x)
            rows.append({
                "k": k,
                "m": m,
                "rel_l2": float((out - exact).norm() / exact.norm()),
                "cosine": float(F.cosine_similarity(out, exact, dim=-1).mean()),
            })  # fmt: skip
    return rows


def evaluate(
    lut_dir: str | os.PathLike,
    model_dir: str | os.PathLike,
    activations: Mapping[str, torch.Tensor],
    *,
    ks: Iterable[int] | None = None,
    ms: Iterable[int] = (0, 8, 32),
    out_dir: str | os.PathLike | None = None,
) -> list[dict]:
    """Evaluate every layer of ``activations`` (``{layer: held-out inputs [N, d]}``).
    Writes ``evaluation.md`` (a table) and ``evaluation.png`` (error against k per
    compensation size) into ``out_dir`` when given."""
    meta = validate_lut(lut_dir)
    model = ModelWeights(model_dir)
    k_active = meta["sae_config"]["k_active"]
    ks = sorted(set(ks or (max(1, k_active // 4), max(1, k_active // 2), k_active, 2 * k_active)))
    ks = [k for k in ks if k <= meta["sae_config"]["num_basis"]]
    rows = []
    for layer, x in activations.items():
        entry = meta["layers"][layer]
        tensors = load_layer_file(Path(lut_dir) / entry["file"])
        for row in evaluate_layer(tensors, model.weight(layer), x, ks=ks, ms=ms):
            rows.append({"layer": layer, **row})
    if out_dir is not None:
        write_report(rows, Path(out_dir), k_active)
    return rows


def write_report(rows: list[dict], out_dir: Path, k_active: int | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    lines = ["| layer | k | m | relative L2 error | cosine |", "|---|---|---|---|---|"]
    lines += [
        f"| {r['layer']} | {r['k']} | {r['m']} | {r['rel_l2']:.4f} | {r['cosine']:.4f} |"
        for r in rows
    ]
    (out_dir / "evaluation.md").write_text("\n".join(lines) + "\n")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in zip(
        axes, ("rel_l2", "cosine"), ("relative L2 error vs exact layer", "cosine vs exact layer"),
        strict=True,
    ):  # fmt: skip
        for layer in dict.fromkeys(r["layer"] for r in rows):
            for m in dict.fromkeys(r["m"] for r in rows):
                sel = [r for r in rows if r["layer"] == layer and r["m"] == m]
                ax.plot([r["k"] for r in sel], [r[key] for r in sel], marker="o", markersize=3,
                        linestyle="-" if m == 0 else "--", label=f"{layer} m={m}")  # fmt: skip
        if k_active is not None:
            ax.axvline(k_active, color="grey", linewidth=0.8, linestyle=":")
        ax.set_xlabel("k (active latents; dotted: the trained k)")
        ax.set_title(label, fontsize=9)
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(
        handles, labels, fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False
    )
    fig.tight_layout()
    fig.savefig(out_dir / "evaluation.png", dpi=110, bbox_inches="tight")
    plt.close(fig)


@torch.no_grad()
def embedding_agreement(
    model_dir: str | os.PathLike,
    lut_dir: str | os.PathLike,
    texts: list[str],
    *,
    compensate: int = 0,
    max_length: int = 128,
) -> float:
    """Mean cosine similarity between the mean-pooled final hidden states of the original
    model and of the model with its LUT layers patched in (a sentence-embedding model's
    own output, e.g. MiniLM)."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    batch = tokenizer(
        texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt"
    )
    mask = batch["attention_mask"].unsqueeze(-1).float()

    def embed(model):
        hidden = model(**batch).last_hidden_state
        return (hidden * mask).sum(1) / mask.sum(1)

    model = AutoModel.from_pretrained(model_dir).eval()
    original = embed(model)
    patch_model(model, lut_dir, compensate=compensate)
    return float(F.cosine_similarity(embed(model), original, dim=-1).mean())


def evaluate_on_passages(
    lut_dir: str | os.PathLike,
    model_dir: str | os.PathLike | None = None,
    *,
    texts: int = 64,
    skip: int = 600,
    max_length: int = 128,
    ks: Iterable[int] | None = None,
    ms: Iterable[int] = (0, 32),
    out_dir: str | os.PathLike | None = None,
) -> dict:
    """The ``evaluate`` stage: ``texts`` corpus passages after the first ``skip`` (those
    the SAEs trained on) are run through the model (``model_dir``, default the packaged
    all-MiniLM-L6-v2) to collect every LUT layer's inputs; returns ``{"layers": rows of
    evaluate(), "embedding_cosine": {m: cosine of the sentence embeddings with every LUT
    layer patched in, compensation m}}``."""
    from ..extract import Extractor, default_model_dir, passages_by_key

    meta = validate_lut(lut_dir)
    model_dir = model_dir or default_model_dir()
    passages = passages_by_key(skip, texts)
    hooks = [f"{layer}:input" for layer in meta["layers"]]
    windows = Extractor(model_dir, hooks, max_length=max_length).run(passages)
    inputs = {
        h.rsplit(":", 1)[0]: torch.cat(
            [torch.from_numpy(w.activations[h].astype("float32")) for w in windows]
        )
        for h in hooks
    }
    ms = list(ms)
    rows = evaluate(lut_dir, model_dir, inputs, ks=ks, ms=ms, out_dir=out_dir)
    cosines = {
        m: embedding_agreement(model_dir, lut_dir, passages, compensate=m, max_length=max_length)
        for m in ms
    }
    return {"layers": rows, "embedding_cosine": cosines}
