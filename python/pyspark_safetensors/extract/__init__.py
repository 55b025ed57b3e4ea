"""Activation extraction: a Hugging Face transformer run inside Spark (``mapInArrow``)
over texts or images, its hook points' activations written as safetensors datasets.
Imports torch and transformers lazily (inside the job and the workers).

``config.py`` (what to extract), ``model.py`` (the transformer and its hook points),
``vision.py`` (vision encoders: every token of an image), ``corpus.py`` (the texts),
``images.py`` (the images: read, checked, numbered), ``workers.py`` (what Spark's
workers run), ``outputs.py`` (the output formats), ``job.py`` (the driver:
``run_extraction``); ``toy_lm.py`` and ``toy_vit.py``: toy models trained here."""

from .config import ExtractConfig, ExtractionSummary, config_hash
from .corpus import demo_passages, load_corpus, passages_by_key
from .job import run_extraction
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
from .vision import ImageTokens, VisionExtractor

__all__ = [
    "DEFAULT_MODEL_ID",
    "ExtractConfig",
    "ExtractionError",
    "ExtractionSummary",
    "Extractor",
    "Hook",
    "ImageTokens",
    "ModelSource",
    "VisionExtractor",
    "config_hash",
    "default_model_dir",
    "demo_passages",
    "load_corpus",
    "passages_by_key",
    "resolve_hooks",
    "resolve_model",
    "run_extraction",
]
