"""Circuits: the replacement model, a causal LM with every MLP block replaced by a
cross-layer transcoder's (or a set of per-layer transcoders', or their LUT's) outputs
(``replacement.py``), its frozen local mode of one prompt (``local.py``), interventions
on its features (``interventions.py``) and its evaluation on held-out text
(``evaluate.py``). Imports torch."""

from .evaluate import evaluate_replacements, replacement_evaluation
from .replacement import (
    Replacement,
    ReplacementError,
    ReplacementModel,
    ReplacementRun,
    Trace,
    clt_replacement,
    load_replacement,
    lut_replacement,
    model_blocks,
    transcoder_replacement,
)

__all__ = [
    "Replacement",
    "ReplacementError",
    "ReplacementModel",
    "ReplacementRun",
    "Trace",
    "clt_replacement",
    "evaluate_replacements",
    "load_replacement",
    "lut_replacement",
    "model_blocks",
    "replacement_evaluation",
    "transcoder_replacement",
]
