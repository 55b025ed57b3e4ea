"""Lookup tables that approximate a model's linear layers through sparse autoencoders
(``lut-format-spec``): the precompute job, validation, ``LUTLinear`` inference and
evaluation. Imports torch."""

from .evaluate import embedding_agreement, evaluate, evaluate_layer, evaluate_on_passages
from .inference import LUTLinear, dense_lut_reference, load_layer_file, patch_model
from .precompute import ModelWeights, precompute_layer, precompute_lut
from .spec import LUTError, validate_lut

__all__ = [
    "LUTError",
    "LUTLinear",
    "ModelWeights",
    "dense_lut_reference",
    "embedding_agreement",
    "evaluate",
    "evaluate_layer",
    "evaluate_on_passages",
    "load_layer_file",
    "patch_model",
    "precompute_layer",
    "precompute_lut",
    "validate_lut",
]
