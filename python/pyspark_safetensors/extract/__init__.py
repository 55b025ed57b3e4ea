"""Activation extraction: a Hugging Face transformer run inside Spark (``mapInArrow``),
its hook points' activations written as safetensors datasets. Imports torch and
transformers lazily (inside the job and the workers)."""

from .job import ExtractConfig, ExtractionSummary, config_hash, load_corpus, run_extraction
from .model import ExtractionError, Extractor, Hook, default_model_dir, resolve_hooks

__all__ = [
    "ExtractConfig",
    "ExtractionError",
    "ExtractionSummary",
    "Extractor",
    "Hook",
    "config_hash",
    "default_model_dir",
    "load_corpus",
    "resolve_hooks",
    "run_extraction",
]
