"""Circuits: a causal LM with every MLP block replaced by a cross-layer transcoder's (or a
set of per-layer transcoders', or their LUT's) outputs, and its evaluation on held-out
text. Imports torch."""

from .evaluate import evaluate_replacements, replacement_evaluation
from .replacement import (
    Replacement,
    ReplacementError,
    ReplacementModel,
    ReplacementRun,
    Trace,
    clt_replacement,
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
    "lut_replacement",
    "model_blocks",
    "replacement_evaluation",
    "transcoder_replacement",
]
