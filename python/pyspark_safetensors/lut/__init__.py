"""Lookup tables that approximate a model's linear layers through sparse autoencoders
(``lut-format-spec``), and whole MLP blocks through transcoders: the precompute job,
validation, ``LUTLinear`` inference (one encode per input for the layers that share an
encoder), ``LUTMLP`` for a block, and evaluation. Imports torch."""

from .evaluate import embedding_agreement, evaluate, evaluate_layer, evaluate_on_passages
from .inference import (
    LUTMLP,
    EncoderGroups,
    LUTEncoder,
    LUTLinear,
    dense_lut_reference,
    load_layer_file,
    load_lut_layers,
    load_lut_mlps,
    patch_model,
)
from .precompute import (
    ModelWeights,
    precompute_clt,
    precompute_layer,
    precompute_lut,
    precompute_mlp,
)
from .spec import LUTError, validate_lut

__all__ = [
    "LUTMLP",
    "EncoderGroups",
    "LUTEncoder",
    "LUTError",
    "LUTLinear",
    "ModelWeights",
    "dense_lut_reference",
    "embedding_agreement",
    "evaluate",
    "evaluate_layer",
    "evaluate_on_passages",
    "load_layer_file",
    "load_lut_layers",
    "load_lut_mlps",
    "patch_model",
    "precompute_clt",
    "precompute_layer",
    "precompute_lut",
    "precompute_mlp",
    "validate_lut",
]
