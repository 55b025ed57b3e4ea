"""SAE architectures behind one protocol (``base.SparseAutoencoder``), keyed by the
config's ``architecture``: SAEs (TopK, BatchTopK, JumpReLU, Matryoshka), transcoders
(plain and skip), crosscoders and cross-layer transcoders. Adding one is a module here with a ``SparseAutoencoder``
subclass and a line in ``ARCHITECTURES``."""

from __future__ import annotations

from ...format.errors import InvalidArgumentError
from .base import PLACEMENT, TINY, SAEOutput, SparseAutoencoder
from .batchtopk import BATCH_TOPK_ROW_CAP, BatchTopKSAE
from .clt import CrossLayerTranscoder
from .crosscoder import CrosscoderSAE
from .jumprelu import JumpReLUSAE
from .matryoshka import MatryoshkaSAE
from .topk import TopKSAE
from .transcoder import SkipTranscoderSAE, TranscoderSAE

ARCHITECTURES: dict[str, type[SparseAutoencoder]] = {
    cls.ARCHITECTURE: cls
    for cls in (
        TopKSAE,
        BatchTopKSAE,
        JumpReLUSAE,
        MatryoshkaSAE,
        TranscoderSAE,
        SkipTranscoderSAE,
        CrosscoderSAE,
        CrossLayerTranscoder,
    )
}


def get_architecture(name: str) -> type[SparseAutoencoder]:
    """The class registered under ``name``; a ValueError naming the known ones otherwise."""
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise InvalidArgumentError(
            f"unknown SAE architecture {name!r}; known: {sorted(ARCHITECTURES)}"
        ) from None


def build_sae(config, *, mesh=None, device=None) -> SparseAutoencoder:
    """A fresh SAE for an ``SAEConfig`` whose ``d`` (and ``d_out``) are known."""
    cls = get_architecture(config.architecture)
    return cls(config.d, config.latents, config.k, d_out=config.d_out or None, mesh=mesh,
               seed=config.seed, device=device, **cls.config_options(config))  # fmt: skip


__all__ = [
    "ARCHITECTURES",
    "BATCH_TOPK_ROW_CAP",
    "PLACEMENT",
    "TINY",
    "BatchTopKSAE",
    "CrossLayerTranscoder",
    "CrosscoderSAE",
    "JumpReLUSAE",
    "MatryoshkaSAE",
    "SAEOutput",
    "SkipTranscoderSAE",
    "SparseAutoencoder",
    "TopKSAE",
    "TranscoderSAE",
    "build_sae",
    "get_architecture",
]
