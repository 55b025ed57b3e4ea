"""What every SAE architecture provides, so the trainer, the checkpoints, the ecosystem
layouts and the LUT job handle them alike.

Every architecture reads ``x [B, d_in]`` and reconstructs ``y_hat = code W_dec + b_dec``
``[B, d_out]`` from a sparse code (an SAE: ``y`` is ``x``, ``d_out = d_in``; a transcoder:
another hook point's activations) and shares the LUT spec's four tensors
``encoder_weight [n, d_in]``, ``encoder_bias [n]``, ``decoder_weight [n, d_out]``,
``decoder_bias [d_out]``; on a mesh with a "model" dimension the first three are sharded
on dim 0 (``PLACEMENT``) and ``decoder_bias`` is replicated. An architecture differs in
how it picks the code from the pre-activations ``W_enc (x - b_dec) + b_enc`` (an SAE;
a transcoder reads ``x`` uncentred) (``forward``), in what it adds to the trainer's loss
(``sparsity_loss``), in what it updates after a forward (``after_forward``) and around
the optimizer's step (``before_update``, ``after_update``), in the tensors
it adds to a checkpoint (``EXTRA_TENSORS``), and in whether the LUT's per-row top-k
reproduces its code (``LUT_REFUSAL``).

A code is ``(values, indices)``, each ``[B, m]``: the active latents' values (0 where a
slot is unused) and their global indices. On a mesh each rank holds the latents of its
own shard; ``decode`` sums over the ranks.
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ...format.errors import InvalidArgumentError
from ..mesh import MODEL, DimMap, all_gather_cat, mesh_dim_size, mesh_rank, reduce_from_model

#: Floor of a variance or norm we divide by (an all-constant batch, a zero row).
TINY = 1e-12

#: Mixed into ``seed`` for the initial weights' generator, so that they are not the draws
#: of anything else seeded alike: SynthSAEBench's model (``evaluation.synthetic``,
#: sae-lens's) draws its true feature directions as ``torch.randn`` after seeding with its
#: seed, and an SAE drawn from the same seed started at the answer (MCC 1.0 at step 0).
INIT_SALT = 0x5AE_1417_D1C7_10A5


def init_generator(seed: int) -> torch.Generator:
    """The generator of an SAE's initial weights for ``seed`` (``INIT_SALT``)."""
    return torch.Generator().manual_seed((seed ^ INIT_SALT) & (2**63 - 1))


#: Where each shared parameter lives on a mesh: latents split along "model", replicated
#: on "data".
PLACEMENT = {
    "encoder_weight": DimMap({MODEL: 0}),
    "encoder_bias": DimMap({MODEL: 0}),
    "decoder_weight": DimMap({MODEL: 0}),
    "decoder_bias": DimMap({}),
}


class SAEOutput(NamedTuple):
    x_hat: torch.Tensor  # [B, d_out] the reconstruction of the target
    values: torch.Tensor  # [B, m] this rank's active values (0 where a slot is unused)
    indices: torch.Tensor  # [B, m] global latent indices of ``values``
    aux_values: torch.Tensor  # [B, k_aux_local] for AuxK (empty when no latent is dead)
    aux_indices: torch.Tensor
    #: Further reconstructions the loss averages with ``x_hat`` (Matryoshka's prefixes,
    #: ``x_hat`` last); empty for the other architectures.
    x_hats: tuple[torch.Tensor, ...] = ()


class SparseAutoencoder(nn.Module):
    """The shared part of every architecture: parameters, decoding, the decoder's unit-norm
    constraint and full-shape state. Subclasses set ``ARCHITECTURE`` and implement
    ``forward(x, *, k=None, dead=None, k_aux=0) -> SAEOutput``.

    ``d``: input width; ``n_latents``: dictionary size (divisible by the model-parallel
    size); ``k``: active latents per input (the target L0 of architectures that do not
    select exactly k); ``d_out``: the reconstruction's width (None: ``d``). Weights are
    initialised identically on every rank from ``seed`` (the decoder with unit-norm rows,
    the encoder as its transpose for an SAE, its own unit-norm rows for a transcoder) and
    each rank keeps its shard, so any mesh starts from the same SAE.
    """

    #: The registry key, also ``architecture`` in the config and the checkpoint metadata.
    ARCHITECTURE: ClassVar[str] = ""
    #: Checkpoint tensors beyond the four shared ones, each sharded like the encoder bias.
    EXTRA_TENSORS: ClassVar[tuple[str, ...]] = ()
    #: Why the LUT's per-row top-k cannot reproduce this architecture's code ("" = it can).
    LUT_REFUSAL: ClassVar[str] = ""
    #: Whether encoding selects the top k (so a stored SAE must record its k).
    SELECTS_TOP_K: ClassVar[bool] = True
    #: Whether the encoder starts as the decoder's transpose (an autoencoder of its input;
    #: a transcoder's input and target live in different spaces).
    TIED_INIT: ClassVar[bool] = True

    def __init__(
        self,
        d: int,
        n_latents: int,
        k: int,
        *,
        d_out: int | None = None,
        mesh=None,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        if not 0 < k <= n_latents:
            raise InvalidArgumentError(f"k must be in 1..n_latents ({n_latents}), got {k}")
        tp = mesh_dim_size(mesh, MODEL)
        if n_latents % tp:
            raise InvalidArgumentError(
                f"n_latents {n_latents} is not divisible by model_parallel_size {tp}"
            )
        self.d, self.n_latents, self.k, self.mesh = d, n_latents, k, mesh
        self.d_out = d_out or d
        self.n_local = n_latents // tp
        self.offset = mesh_rank(mesh, MODEL) * self.n_local
        gen = init_generator(seed)
        full = self._initial_state(gen) | self._extra_parameters()
        for name, tensor in full.items():
            local = self.placement(name).distribute(tensor, mesh)
            self.register_parameter(name, nn.Parameter(local.to(device=device, dtype=dtype)))

    def _initial_state(self, gen: torch.Generator) -> dict[str, torch.Tensor]:
        """Full-shape starting values of the shared parameters, drawn from ``gen`` (the
        same on every rank)."""
        dec = torch.randn(self.n_latents, self.d_out, generator=gen, dtype=torch.float32)
        dec /= dec.norm(dim=1, keepdim=True)
        if self.TIED_INIT and self.d_out == self.d:
            enc = dec.clone()
        else:
            enc = torch.randn(self.n_latents, self.d, generator=gen, dtype=torch.float32)
            enc /= enc.norm(dim=1, keepdim=True)
        return {
            "encoder_weight": enc,
            "encoder_bias": torch.zeros(self.n_latents),
            "decoder_weight": dec,
            "decoder_bias": torch.zeros(self.d_out),
        }

    def _extra_parameters(self) -> dict[str, torch.Tensor]:
        """Full-shape starting values of the parameters an architecture adds to the four
        shared ones (placed by ``placement``)."""
        return {}

    @classmethod
    def config_options(cls, config) -> dict:
        """This architecture's constructor options taken from an ``SAEConfig``."""
        return {}

    @classmethod
    def stored_options(cls, metadata: dict) -> dict:
        """This architecture's constructor options taken from a stored SAE's metadata
        (what ``metadata()`` wrote)."""
        return {}

    @property
    def architecture(self) -> str:
        return self.ARCHITECTURE

    def placement(self, name: str) -> DimMap:
        """Where parameter ``name`` (or its optimizer state) lives on the mesh: the shared
        ones as ``PLACEMENT`` says, an architecture's per-latent ones with the latents."""
        return PLACEMENT.get(name, DimMap({MODEL: 0}))

    # --- latents and their per-latent state -------------------------------------------------

    @property
    def latents_total(self) -> int:
        """Every latent of the dictionary (a cross-layer transcoder: of every layer)."""
        return self.n_latents

    @property
    def target_blocks(self) -> int:
        """Equal-width blocks of ``y`` whose FVUs the trainer's loss sums, each normalised
        by its own variance (1: the FVU of the whole ``y``)."""
        return 1

    def local_latents(self, indices: torch.Tensor) -> torch.Tensor:
        """Positions in this rank's per-latent vectors (``[n_local]``) of global indices
        this rank holds."""
        return indices - self.offset

    def gather_latents(self, local: torch.Tensor) -> torch.Tensor:
        """A per-latent vector ``[n_local]`` gathered in global latent order (collective)."""
        return PLACEMENT["encoder_bias"].gather(local, self.mesh)

    def distribute_latents(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's share of a per-latent vector in global latent order."""
        return PLACEMENT["encoder_bias"].distribute(full, self.mesh)

    def latent_groups(self) -> dict[str, slice]:
        """Named ranges of the global latent order evaluated on their own (held-out
        ``l0_<name>`` and ``dead_fraction_<name>``); none by default."""
        return {}

    # --- the code ------------------------------------------------------------------------

    def decode_latents(self, values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """``sum_j values[:, j] * decoder_weight[indices[:, j]]`` over every model rank,
        without ``decoder_bias``; ``indices`` are global."""
        part = F.embedding_bag(
            indices - self.offset,
            self.decoder_weight,
            per_sample_weights=values.to(self.decoder_weight.dtype),
            mode="sum",
        )
        return reduce_from_model(part, self.mesh)

    def encode(self, x: torch.Tensor, k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The code of ``x [B, d]``: ``(values, indices)``, each ``[B, m]`` (on a mesh, this
        rank's latents)."""
        out = self(x, k=k)
        return out.values, out.indices

    def encode_dense(self, x: torch.Tensor, k: int | None = None) -> torch.Tensor:
        """The code of ``x [B, d]`` as one ``[B, latents_total]`` tensor (0 where a latent is
        silent), as the tools that grade SAEs take it (SAELens' ``encode``); on a mesh,
        this rank's latents (the others 0)."""
        values, indices = self.encode(x, k)
        dense = values.new_zeros(values.shape[0], self.latents_total)
        return dense.scatter_add_(1, indices, values)

    def decode(self, values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """The reconstruction ``sum_j values_j W_dec[indices_j] + b_dec`` of a code (a skip
        transcoder's ``forward`` adds its linear path to it)."""
        return self.decode_latents(values, indices) + self.decoder_bias

    def _empty_aux(self, values: torch.Tensor, indices: torch.Tensor):
        return values[:, :0], indices[:, :0]

    def _global_top(self, vals: torch.Tensor, k: int) -> torch.Tensor:
        """Zero this rank's candidates ``vals [B, m]`` that lose the top k of their row
        over every model rank (one all-gather; alone, all of them win)."""
        if mesh_dim_size(self.mesh, MODEL) == 1:
            return vals
        cand = all_gather_cat(vals.detach(), self.mesh, MODEL, dim=1)  # [B, tp * m]
        win = torch.zeros_like(cand, dtype=torch.bool)
        win.scatter_(1, cand.topk(k, dim=1, sorted=False).indices, True)
        rank = mesh_rank(self.mesh, MODEL)
        return vals * win[:, rank * vals.shape[1] : (rank + 1) * vals.shape[1]]

    # --- the trainer's hooks ---------------------------------------------------------------

    def sparsity_loss(self, out: SAEOutput) -> torch.Tensor | None:
        """A term added to this rank's loss (None: the code is sparse by construction),
        scaled so that the gradients averaged over "data" are those of the global batch.
        Collective on every rank when it is not None."""
        return None

    def after_forward(self) -> None:
        """Called by the trainer after each forward of a training step (collective on every
        rank when the architecture keeps batch statistics)."""

    def before_update(self) -> None:
        """Called by the trainer once the gradients are averaged over "data", before they
        are clipped and the optimizer steps: an SAE drops the decoder gradient's part along
        each unit row (``remove_parallel_gradient``)."""
        self.remove_parallel_gradient()

    def after_update(self) -> None:
        """Called by the trainer after the optimizer's step: an SAE's decoder rows go back
        to unit norm (``normalize_decoder``)."""
        self.normalize_decoder()

    def evaluation_parts(
        self, out: SAEOutput, y: torch.Tensor
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Reconstructions evaluated on their own beside the whole, by name:
        ``{name: (part of y_hat, that part of y)}`` (held-out ``fvu_<name>``)."""
        return {}

    def metadata(self) -> dict[str, str]:
        """What the checkpoint's metadata records about the architecture."""
        return {"architecture": self.ARCHITECTURE, "activation": self.ARCHITECTURE}

    # --- constraints and state -----------------------------------------------------------

    @torch.no_grad()
    def normalize_decoder(self) -> None:
        self.decoder_weight /= self.decoder_weight.norm(dim=1, keepdim=True).clamp_min(TINY)

    @torch.no_grad()
    def remove_parallel_gradient(self) -> None:
        """Drop the decoder gradient's component along each (unit) row, so the step moves
        rows along the sphere instead of fighting the renormalisation."""
        w, g = self.decoder_weight, self.decoder_weight.grad
        if g is not None:
            g -= (g * w).sum(dim=1, keepdim=True) * w

    def full_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every checkpoint tensor's full shape, by name."""
        n = self.n_latents
        shapes = {
            "encoder_weight": (n, self.d),
            "encoder_bias": (n,),
            "decoder_weight": (n, self.d_out),
            "decoder_bias": (self.d_out,),
        }
        return shapes | {name: (n,) for name in self.EXTRA_TENSORS}

    def local_state(self) -> dict[str, torch.Tensor]:
        """This rank's shard of every checkpoint tensor (the shared parameters and
        ``EXTRA_TENSORS``), by checkpoint name."""
        names = self.full_shapes()
        return {name: p.detach() for name, p in self.named_parameters() if name in names}

    def load_local_state(self, local: dict[str, torch.Tensor]) -> None:
        """Set this rank's shards from checkpoint-named local tensors."""
        for name, p in self.named_parameters():
            if name in local:
                p.copy_(local[name])

    def full_state(self) -> dict[str, torch.Tensor]:
        """Every checkpoint tensor gathered to its full shape (a collective on every rank)."""
        return {
            name: self.placement(name).gather(t, self.mesh).contiguous()
            for name, t in self.local_state().items()
        }

    @torch.no_grad()
    def load_full_state(self, state: dict[str, torch.Tensor]) -> None:
        """Load full-shape tensors (every rank passes the same), keeping this rank's shard."""
        local = {}
        for name, want in self.full_shapes().items():
            if name not in state:
                raise InvalidArgumentError(f"{name}: missing, a {self.ARCHITECTURE} SAE needs it")
            got = tuple(state[name].shape)
            if got != want:
                raise InvalidArgumentError(f"{name}: checkpoint shape {got}, this SAE needs {want}")
            local[name] = self.placement(name).distribute(state[name].to(torch.float32), self.mesh)
        self.load_local_state(local)
