"""The research pipeline's cross-layer transcoder stage: the CLT's whole-model LUT
(``lut.precompute_clt``), and the replacement models evaluated side by side on held-out
text — the CLT, its LUT, and the per-layer transcoders trained on the same tokens with
the same total latents (and their LUT when one holds every block)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path


def clt_figures(
    *,
    model_dir: str | os.PathLike,
    clt_file: str | os.PathLike,
    transcoders: Mapping[str, str | os.PathLike],
    per_layer_lut: str | os.PathLike | None,
    texts: Sequence[str],
    max_length: int,
    out_dir: Path,
    lut_dtype: str = "float16",
) -> dict:
    """Writes ``out_dir/lut`` (the CLT's LUT) and returns the figures:
    ``replacement_evaluation``'s report with the models "clt" (the top k per layer per
    row), "clt_threshold" (the file's JumpReLU thresholds, what circuit-tracer runs),
    "clt_lut", "per_layer" and "per_layer_lut" (those given), plus ``latents`` (each
    model's total latents and k per layer). ``max_length`` 0 = the model's context."""
    from ..extract.model import load_model
    from ..lut.precompute import precompute_clt
    from ..lut.spec import validate_lut
    from .evaluate import replacement_evaluation
    from .replacement import clt_replacement, lut_replacement, transcoder_replacement

    precompute_clt(model_dir, clt_file, out_dir=out_dir / "lut", dtype=lut_dtype)
    tokenizer, model = load_model(model_dir)
    clt = clt_replacement(model, clt_file)  # the top k per layer per row: the trained code
    replacements = {"clt": clt, "clt_threshold": clt_replacement(model, clt_file, rule="threshold"),
                    "clt_lut": lut_replacement(model, out_dir / "lut")}  # fmt: skip
    if transcoders:
        replacements["per_layer"] = transcoder_replacement(model, transcoders)
        blocks = set(validate_lut(per_layer_lut)["layers"]) if per_layer_lut else set()
        if set(transcoders) <= blocks:
            replacements["per_layer_lut"] = lut_replacement(model, per_layer_lut)
    length = max_length or int(getattr(model.config, "max_position_embeddings", 128))
    report = replacement_evaluation(model, tokenizer, list(texts), replacements, max_length=length)
    report["latents"] = {
        name: {"total": sum(len(w) for w in r.encoder_weight), "k_per_layer": r.k,
               "layers": r.n_layers}
        for name, r in replacements.items()
    }  # fmt: skip
    return report
