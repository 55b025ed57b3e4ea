"""Activation extraction: a Hugging Face transformer run inside Spark (``mapInArrow``),
its hook points' activations written as safetensors datasets. Imports torch and
transformers lazily (inside the job and the workers)."""

from .corpus import demo_passages, load_corpus, passages_by_key
from .job import ExtractConfig, ExtractionSummary, config_hash, run_extraction
from .model import (
    DEFAULT_MODEL_ID,
    ExtractionError,
    Extractor,
    Hook,
    ModelSource,
    default_model_dir,
    resolve_hooks,
    resolve_model,
)

__all__ = [
    "DEFAULT_MODEL_ID",
    "ExtractConfig",
    "ExtractionError",
    "ExtractionSummary",
    "Extractor",
    "Hook",
    "ModelSource",
    "config_hash",
    "default_model_dir",
    "demo_passages",
    "load_corpus",
    "passages_by_key",
    "resolve_hooks",
    "resolve_model",
    "run_extraction",
]
