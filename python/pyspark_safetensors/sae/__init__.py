"""Sparse autoencoders (TopK, BatchTopK, JumpReLU, Matryoshka), transcoders,
crosscoders and cross-layer transcoders (``architectures/``) trained on activation datasets, on one process or a
("data", "model") DeviceMesh. Imports torch on first use of any name but ``SAEConfig``."""

import importlib

from .config import SAEConfig

# The rest imports torch: loaded on first use, so that a command line's configuration
# (``SAEConfig``) and its --help come without it.
_SUBMODULE = {
    **dict.fromkeys(
        (
            "ARCHITECTURES",
            "BatchTopKSAE",
            "CrossLayerTranscoder",
            "CrosscoderSAE",
            "JumpReLUSAE",
            "MatryoshkaSAE",
            "SkipTranscoderSAE",
            "SparseAutoencoder",
            "TopKSAE",
            "TranscoderSAE",
        ),
        "architectures",
    ),
    **dict.fromkeys(("CheckpointError", "load_sae", "save_sae"), "checkpoint"),
    **dict.fromkeys(("export_sae", "load_sae_model", "read_sae"), "ecosystem"),
    **dict.fromkeys(("DimMap", "make_mesh", "mesh_dim_size", "mesh_rank"), "mesh"),
    "dense_reference": "model",
}


def __getattr__(name: str):
    if name in _SUBMODULE:
        return getattr(importlib.import_module(f".{_SUBMODULE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["SAEConfig", *sorted(_SUBMODULE)]
