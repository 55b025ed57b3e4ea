"""SAE architectures behind one protocol (``base.SparseAutoencoder``), keyed by the
config's ``architecture``. Adding one is a module here with a ``SparseAutoencoder``
subclass and a line in ``ARCHITECTURES``."""

from __future__ import annotations

from ...format.errors import InvalidArgumentError
from .base import PLACEMENT, TINY, SAEOutput, SparseAutoencoder
from .batchtopk import BATCH_TOPK_ROW_CAP, BatchTopKSAE
from .jumprelu import JumpReLUSAE
from .topk import TopKSAE

ARCHITECTURES: dict[str, type[SparseAutoencoder]] = {
    cls.ARCHITECTURE: cls for cls in (TopKSAE, BatchTopKSAE, JumpReLUSAE)
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
    """A fresh SAE for an ``SAEConfig`` whose ``d`` is known."""
    cls = get_architecture(config.architecture)
    return cls(config.d, config.latents, config.k, mesh=mesh, seed=config.seed, device=device,
               **cls.config_options(config))  # fmt: skip


__all__ = [
    "ARCHITECTURES",
    "BATCH_TOPK_ROW_CAP",
    "PLACEMENT",
    "TINY",
    "BatchTopKSAE",
    "JumpReLUSAE",
    "SAEOutput",
    "SparseAutoencoder",
    "TopKSAE",
    "build_sae",
    "get_architecture",
]
