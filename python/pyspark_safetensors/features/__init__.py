"""What each SAE latent means, over every token of an extraction: statistics, histogram,
top-activating contexts and random examples per quantile band, computed by a Spark job
(``run_features``), checked against a single-process loop (``reference_state``), and shown
by a static browser (``index.html`` beside the two parquet tables)."""

from .config import FeaturesConfig, FeaturesError
from .job import FeaturesSummary, plan_features, run_features
from .reference import reference_state

__all__ = [
    "FeaturesConfig",
    "FeaturesError",
    "FeaturesSummary",
    "plan_features",
    "reference_state",
    "run_features",
]
