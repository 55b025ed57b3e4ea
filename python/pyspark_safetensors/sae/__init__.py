"""Sparse autoencoders (TopK, BatchTopK, JumpReLU: ``architectures/``) trained on
activation datasets, on one process or a ("data", "model") DeviceMesh. Imports torch."""

from .architectures import ARCHITECTURES, BatchTopKSAE, JumpReLUSAE, SparseAutoencoder, TopKSAE
from .checkpoint import CheckpointError, load_sae, save_sae
from .config import SAEConfig
from .ecosystem import export_sae, load_sae_model, read_sae
from .mesh import DimMap, make_mesh, mesh_dim_size, mesh_rank
from .model import dense_reference

__all__ = [
    "ARCHITECTURES",
    "BatchTopKSAE",
    "CheckpointError",
    "DimMap",
    "JumpReLUSAE",
    "SAEConfig",
    "SparseAutoencoder",
    "TopKSAE",
    "dense_reference",
    "export_sae",
    "load_sae",
    "load_sae_model",
    "make_mesh",
    "mesh_dim_size",
    "mesh_rank",
    "read_sae",
    "save_sae",
]
