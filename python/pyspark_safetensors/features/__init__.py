"""What each SAE latent means, over every token of an extraction: statistics, histogram,
top-activating contexts and random examples per quantile band, computed by a Spark job
(``run_features``), checked against a single-process loop (``reference_state``), and shown
by a static browser (``index.html`` beside the two parquet tables). A crosscoder's
tokens are its hook points' row-aligned datasets read together, each row their rows
concatenated (``datasets``; the examples are the first's tokens). An image extraction's
examples are images with the latent's heat map over their patches, and per-patch labels
of generative factors give each factor value its best latent by AUROC (``ground_truth``)."""

import importlib

from .config import FeaturesConfig, FeaturesError

# The job and the reference loop import torch: loaded on first use, so that a command
# line's configuration and its --help come without it.
_SUBMODULE = {
    **dict.fromkeys(("FeaturesSummary", "plan_features", "run_features"), "job"),
    "reference_state": "reference",
}


def __getattr__(name: str):
    if name in _SUBMODULE:
        return getattr(importlib.import_module(f".{_SUBMODULE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["FeaturesConfig", "FeaturesError", *sorted(_SUBMODULE)]
