"""Cross-layer transcoders (Ameisen et al. 2025, "Circuit Tracing"; sparsify's
``cross_layer``): L layers of an MLP stack, each with its own sparse code read from that
layer's MLP input, and each layer's MLP output reconstructed from the codes of every layer
at or below it:

    z_l = act(W_enc^l x_l + b_enc^l)                         [B, n]  (n latents per layer)
    y_hat_t = sum_{l <= t} z_l W_dec^{l->t} + b_dec^t         [B, d_out]

``act`` keeps k latents per layer: the k largest of ``ReLU(pre)`` per row ("topk"), or
the ``k x B`` largest of the batch, per layer, in training ("batchtopk"). A per-layer
transcoder set is the case whose decoders are only the ``l -> l`` ones. With
``tied_decoders`` each source layer has one decoder that every target at or above it
shares (``W_dec^{l->t} = W_dec^l``).

**The file** (one safetensors file, float32; l, t are positions 0..L-1 in
``hook_points``): ``encoder_weight [L, n, d_in]``, ``encoder_bias [L, n]``,
``decoder_weight.{l} [n, L - l, d_out]`` (slot j is target layer l + j; tied: ``[n, 1,
d_out]``), ``decoder_bias [L, d_out]``, ``threshold [L, n]``; the metadata records
``architecture = "clt"``, ``k``, ``n_layers``, ``d_in``, ``d_out``, ``n_latents`` (per
layer), ``hook_points``, ``target_hook_points``, ``blocks``, ``tied_decoders`` and
``activation``.

**Inference** (``encode_layer``): the top k per row by default, or a JumpReLU
``z = pre * 1[pre > threshold]`` with the per-latent ``threshold``. **The threshold
rule** (``calibrate_thresholds``, run by the trainer on the first ``THRESHOLD_SAMPLES``
training rows and their targets before every checkpoint), in two steps. Frequency
matching: if latent i was selected by the training selection on c_i of the N rows and
``v_(1) >= v_(2) >= ...`` are its N pre-activations sorted, ``threshold_i = max(0,
(v_(c_i) + v_(c_i + 1)) / 2)`` (``v_(0) = v_(1)``, ``v_(N+1) = 0``): each latent fires as
often as the training code fired it, but on its c_i largest rows, which the top-k did
not always pick (a row may have had k larger competitors), while the decoders were
fitted to the top-k's rows. Least error: each latent's threshold then moves to the cut
of its rows (sorted by pre-activation) that gives the least reconstruction error at the
training code's L0, the rest of the code held: firing latent i with value p on row r
changes the squared error, weighted as the loss weighs the layers, by ``-g_r = -(2 p
<e_r, D_i> + (2 a_r - 1) p^2 |D_i|^2)`` (e_r the row's error, D_i the latent's decoder
rows to every target, a_r whether the code fires it already); each latent takes the j
rows maximising ``sum of its j largest rows' g - lam j``, with the least ``lam >= 0``
(bisection) that keeps the layer's firings on the rows within the training selection's
(k per row for TopK). Two rounds, against the top-k code's error and then the first
thresholds'; of the three threshold sets the one with the least error on the rows is
kept. Without targets, frequency matching alone. Memory: ``THRESHOLD_SAMPLES x n``
floats per layer (this rank's latents). In eval mode with ``inference = "threshold"``
the forward encodes by this rule exactly as ``encode_layer`` (and circuit-tracer) does:
every latent above its threshold, however many a row fires (``_threshold_forward``).

**Trained thresholds** (``SAEConfig.clt_thresholds = "trained"``, the default; the
metadata's ``threshold_source``). Calibrated thresholds copy a code the dictionary was
not trained for: on the synthetic layers of ``python -m benchmarks clt_quality`` their
held-out FVU is 0.337 against the top-k's 0.149 (at L0 5.1 per layer: the least-error
cut fires fewer than k). So after the top-k training the trainer fine-tunes under the
threshold code itself (``Trainer.train_thresholds``; a top-k code turned into a JumpReLU
one as crosslayer-coding turns its BatchTopK CLTs, then trained with the estimators of
Rajamanoharan et al. 2024, "Jumping Ahead"): ``clt_threshold_fraction`` of the training
tokens again (a loader of its own),
from the frequency-matched thresholds (L0 = k; starting from the least-error ones, the
first steps went to climbing back to k), the loss the training's (pooled FVU) of the
code ``z = pre * 1[pre > theta]`` plus ``l0_coef * sum_l (L0_l / k - 1)^2`` over the
global batch (each layer's L0 held at k). The step has no gradient: ``ThresholdCode``
passes the gradient to ``pre`` where the latent fired and to ``theta`` through the
rectangle kernel, ``-(theta / eps) K((pre - theta) / eps)``, the L0 penalty through
``-(1 / eps) K(...)`` (``jumprelu.py``'s estimators), ``eps`` per layer
``clt_threshold_bandwidth`` times its median threshold. The thresholds train as
``log_threshold`` (a parameter sharded with the encoder rows, Adam at
``clt_threshold_lr``: a step moves a threshold by about that fraction of itself,
whatever the layer's scale), the dictionary at ``clt_threshold_dictionary_lr`` of the
learning rate (the encoder stepped about ``input_mean`` as in training), both warmed up
and decayed as the training's rate. A forward lists each layer's entries above ``theta
- eps / 2`` (the fired ones and those within the kernel's reach), so the encoder's
backward touches only those (``EntryEncode``) and the decoders sum them by row
(``embedding_bag`` with offsets). Measured (``docs/BENCHMARKS.md``): on the
``clt_quality`` layers the threshold code's held-out FVU falls from 0.337 to 0.229 at
L0 15.9 (0.5 of the tokens; 0.253 at 0.25, 0.207 at 1, 0.166 after 4 with the
dictionary at half the rate), the top-k rule of the same file 0.153 against 0.149: with
log-normal atom magnitudes of log-sd 1 a row's interference grows with its largest atom,
which a per-row top-k follows and one cut per latent cannot (with every atom alike, log-sd
0, the trained thresholds beat the top k: 0.188 against 0.202). On the CLT demo's toy Llama (``conf/pipeline-clt.toml``,
k = 16) the trained thresholds replace every MLP at CE loss recovered 0.9885 against the
top-k training's top k 0.9837 (its calibrated thresholds 0.9812), every block's FVU lower,
at an L0 1-2.5 % over k on held-out text.

**Training.** The trainer feeds ``x = concat_l x_l [B, L d_in]`` and
``y = concat_t y_t [B, L d_out]``; the code is ``(values, indices)`` ``[B, L m]``, layer
l's m slots first, with global latent indices ``l n + i``. The loss (``pooled_loss``,
``SAEConfig.clt_loss``) is the FVU of all L targets together, every layer's squared
error over the sum of the layers' batch variances, so each layer weighs by its output's
variance, as its error weighs in the residual stream the replacement model adds the
outputs to; or (``per_layer``) the sum of the L per-layer FVUs (``target_blocks``), so a
layer of small variance weighs as much as one of large variance. As a transcoder
(``transcoder.py``), the decoders start at zero and keep no unit norm, the encoders start
centred on each layer's input mean, and the steps are taken about that mean
(``input_mean [L, d_in]``, a buffer of the trainer's state, never in the file). AuxK
picks each layer's dead latents and asks them for the residual of the targets at or
above their layer. On a mesh the latents of every layer shard along "model" (rank r
holds latents ``r n/tp .. (r+1) n/tp`` of each layer); the per-layer top-k costs one
all-gather for all layers, the decoders' partial sums one all-reduce.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from typing import ClassVar

import torch
import torch.nn.functional as F

from ...format.errors import InvalidArgumentError
from ..mesh import (
    DATA,
    MODEL,
    DimMap,
    all_gather_cat,
    all_reduce,
    copy_to_model,
    mesh_dim_size,
    mesh_rank,
    reduce_from_model,
)
from .base import SAEOutput, SparseAutoencoder
from .batchtopk import BATCH_TOPK_ROW_CAP
from .jumprelu import EntryEncode, Fires, ThresholdCode
from .topk import _TopKEncode

#: Training rows the per-latent thresholds are calibrated on (module docstring).
THRESHOLD_SAMPLES = 8192
#: The activations a CLT trains with.
ACTIVATIONS = ("topk", "batchtopk")

_BY_LATENT = DimMap({MODEL: 1})  # [L, n] tensors: each layer's latents split over "model"
_DECODER = DimMap({MODEL: 0})  # [n, S, d_out]: the source layer's latents split
_REPLICATED = DimMap({})


def decoder_name(layer: int) -> str:
    """The file's name of source layer ``layer``'s decoder."""
    return f"decoder_weight.{layer}"


#: Hook names of TransformerLens (and circuit-tracer, whose configs name a dictionary's
#: hooks ``blocks.{i}.{feature_input_hook}``) at the MLP block of layer i, after
#: ``blocks.{i}.``: what each is of that block. "residual" is the residual stream before
#: the block's norm (``hook_resid_mid``; TransformerLens's ``hook_mlp_in`` is a copy of it
#: taken before ``ln2``), which no replacement of the block reads.
TL_BLOCK_HOOKS = {
    "mlp": "block", "mlp.hook_in": "input", "ln2.hook_normalized": "input",
    "mlp.hook_out": "output", "hook_mlp_out": "output",
    "hook_resid_mid": "residual", "hook_mlp_in": "residual",
}  # fmt: skip
_TL_NAME = re.compile(r"^(?:.*\.)?blocks\.(\d+)\.(.+)$")

#: The metadata key recording how a dictionary's JumpReLU thresholds were set (absent:
#: it holds none, and ``rule="threshold"`` is refused): ``THRESHOLD_SOURCES``.
THRESHOLD_SOURCE = "threshold_source"
THRESHOLD_SOURCES = ("calibrated", "trained", "peer")
""""calibrated": ``calibrate_thresholds`` (the trainer, before every checkpoint);
"trained": a straight-through JumpReLU fine-tune; "peer": read from another library's
file (circuit-tracer's JumpReLU or ReLU transcoders, SAELens' JumpReLU SAEs), its own
activation function."""


def block_of(hook_point: str, blocks: Sequence[str] | None = None) -> str:
    """The MLP block a hook point names: the one rule of block names. Without ``blocks``,
    the module of our ``<module>:input`` (or ``:output``) hook points, any other name as it
    is. With ``blocks`` (a model's MLP block modules in layer order,
    ``circuits.model_blocks``), the one of them the name means, in our convention or
    another library's:

    - a block's module name, bare or with ``:input``/``:output`` (ours) or circuit-tracer's
      ``.hook_in``/``.hook_out`` (``model.layers.0.mlp``, ``transformer.h.0.mlp:input``);
    - a name relative to the model's base model, the one block ending with it (sparsify's
      hook points, ``layers.0.mlp``, ``h.0.mlp``);
    - TransformerLens's and circuit-tracer's ``blocks.{i}.{hook}`` (``TL_BLOCK_HOOKS``:
      ``blocks.0.mlp.hook_in``, ``blocks.0.ln2.hook_normalized``, ``blocks.0.hook_mlp_out``):
      block i.

    Refused, naming the blocks, when it means none of them; and a hook on the residual
    stream before the block's norm (``blocks.{i}.hook_resid_mid``, TransformerLens's
    ``blocks.{i}.hook_mlp_in``), which a replacement of the block never sees."""
    module, sep, side = hook_point.rpartition(":")
    module = module if sep and side in ("input", "output") else hook_point
    if blocks is None:
        return module
    blocks = list(blocks)
    if module in blocks:
        return module
    tl = _TL_NAME.match(module)
    if tl:
        layer, hook = int(tl.group(1)), tl.group(2)
        kind = TL_BLOCK_HOOKS.get(hook)
        if kind == "residual":
            raise InvalidArgumentError(
                f"{hook_point!r} is the residual stream before block {layer}'s MLP norm, not the "
                "MLP's input: a replacement of the block encodes what the block reads (its "
                f"input, blocks.{layer}.mlp.hook_in or blocks.{layer}.ln2.hook_normalized), so a "
                "dictionary trained on this hook does not fit it"
            )
        if kind is not None and layer < len(blocks):
            return blocks[layer]
    for suffix in (".hook_in", ".hook_out"):
        if module.endswith(suffix) and module[: -len(suffix)] in blocks:
            return module[: -len(suffix)]
    ending = [b for b in blocks if b.endswith(f".{module}")]
    if len(ending) == 1:
        return ending[0]
    raise InvalidArgumentError(
        f"{hook_point!r} names no MLP block of the model; its blocks: {blocks} (also read: "
        "a block relative to the base model, e.g. layers.0.mlp; TransformerLens / "
        "circuit-tracer's blocks.{i}.mlp.hook_in, blocks.{i}.hook_mlp_out)"
    )


def dictionary_rule(paths: Sequence[str | os.PathLike]) -> str:
    """The inference rule a dictionary's files were made for (one CLT file, or per-layer
    transcoder files): "threshold" when every file's JumpReLU thresholds were trained
    under that code (metadata ``threshold_source = "trained"``) -- the rule an export to
    circuit-tracer runs, so the pipeline's graphs use it too --, else "topk" (calibrated
    thresholds only copy the top-k code; per-layer transcoders hold none)."""
    from ...format import SafetensorsFile

    def source(path) -> str | None:
        with SafetensorsFile(path) as f:
            return (f.metadata or {}).get(THRESHOLD_SOURCE)

    trained = bool(paths) and all(source(p) == "trained" for p in paths)
    return "threshold" if trained else "topk"


def clt_file_shapes(metadata: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of a CLT file and its shape, from the file's metadata."""
    try:
        n_layers, n = int(metadata["n_layers"]), int(metadata["n_latents"])
        d_in, d_out = int(metadata["d_in"]), int(metadata["d_out"])
    except (KeyError, TypeError, ValueError) as e:
        raise InvalidArgumentError(
            f"a CLT file's metadata needs integer n_layers, n_latents, d_in, d_out ({e})"
        ) from None
    tied = str(metadata.get("tied_decoders", "false")).lower() == "true"
    shapes = {
        "encoder_weight": (n_layers, n, d_in),
        "encoder_bias": (n_layers, n),
        "decoder_bias": (n_layers, d_out),
        "threshold": (n_layers, n),
    }
    for layer in range(n_layers):
        shapes[decoder_name(layer)] = (n, 1 if tied else n_layers - layer, d_out)
    return shapes


class CrossLayerTranscoder(SparseAutoencoder):
    """A cross-layer transcoder over ``n_layers`` MLP layers: ``d`` inputs and ``d_out``
    outputs per layer, ``n_latents`` latents per layer, ``k`` active per layer."""

    ARCHITECTURE = "clt"
    TIED_INIT = False
    LUT_REFUSAL = (
        "a cross-layer transcoder's block t is decoded from the codes of every layer at or "
        "below t; its LUT is one per block, made from all of them, not from one SAE"
    )
    #: How an eval-mode forward encodes ("topk" or "threshold"; ``encode_layer``).
    INFERENCE: ClassVar[tuple[str, ...]] = ("topk", "threshold")

    def __init__(
        self,
        d: int,
        n_latents: int,
        k: int,
        *,
        n_layers: int = 1,
        tied_decoders: bool = False,
        activation: str = "topk",
        pooled_loss: bool = True,
        hook_points: Sequence[str] = (),
        target_hook_points: Sequence[str] = (),
        **kwargs,
    ):
        if n_layers < 1:
            raise InvalidArgumentError(f"a CLT needs at least one layer, got {n_layers}")
        if activation not in ACTIVATIONS:
            raise InvalidArgumentError(
                f"clt activation must be one of {ACTIVATIONS}, got {activation!r}"
            )
        self.n_layers, self.tied_decoders, self.activation = (
            n_layers,
            bool(tied_decoders),
            activation,
        )
        #: How the layers' errors weigh (``SAEConfig.clt_loss``): pooled, each by its
        #: output's variance; or each layer's FVU alike. The thresholds weigh them so too.
        self.pooled_loss = bool(pooled_loss)
        super().__init__(d, n_latents, k, **kwargs)
        self.n_layer_local = self.n_local
        self.n_local = n_layers * self.n_layer_local  # the trainer's per-latent vectors
        self.hook_points = tuple(hook_points)
        self.target_hook_points = tuple(target_hook_points)
        self.inference = "topk"
        device = self.encoder_weight.device
        self.register_buffer("input_mean", torch.zeros(n_layers, d, device=device))
        # a plain tensor, not a buffer: it is this rank's shard and travels in the file,
        # never in the trainer's (rank 0's) buffers
        self.threshold = torch.zeros(n_layers, self.n_layer_local, device=device)
        #: How ``threshold`` was set (``THRESHOLD_SOURCES``), None while it holds none.
        self.threshold_source: str | None = None
        self._shift: torch.Tensor | None = None
        #: The thresholds' fine-tune (``begin_threshold_training``): its kernel width per
        #: layer, its L0 penalty's weight, and the last batch's candidates for that penalty.
        self.bandwidth: torch.Tensor | None = None
        self.l0_coef = 0.0
        self.last_penalty = 0.0
        self._tuned: list[tuple[torch.Tensor, ...]] | None = None

    # --- parameters --------------------------------------------------------------------

    def _initial_state(self, gen: torch.Generator) -> dict[str, torch.Tensor]:
        L, n = self.n_layers, self.n_latents
        enc = torch.randn(L, n, self.d, generator=gen, dtype=torch.float32)
        enc /= enc.norm(dim=2, keepdim=True)
        state = {"encoder_weight": enc, "encoder_bias": torch.zeros(L, n)}
        for layer in range(L):  # zero: each latent's first tokens write its outputs
            slots = 1 if self.tied_decoders else L - layer
            state[f"decoder_weight_{layer}"] = torch.zeros(n, slots, self.d_out)
        return state | {"decoder_bias": torch.zeros(L, self.d_out)}

    def placement(self, name: str) -> DimMap:
        if name in ("encoder_weight", "encoder_bias", "threshold", "log_threshold"):
            return _BY_LATENT
        if name.startswith("decoder_weight"):
            return _DECODER
        return _REPLICATED

    def decoder_weights(self) -> list[torch.Tensor]:
        """Each source layer's local decoder ``[n_local, S, d_out]``."""
        return [getattr(self, f"decoder_weight_{layer}") for layer in range(self.n_layers)]

    def decoder(self, source: int, target: int) -> torch.Tensor:
        """``W_dec^{source->target}``, this rank's rows ``[n_local, d_out]``."""
        if not 0 <= source <= target < self.n_layers:
            raise InvalidArgumentError(
                f"a CLT of {self.n_layers} layers decodes source <= target, got {source} -> {target}"
            )
        return self.decoder_weights()[source][:, 0 if self.tied_decoders else target - source]

    @classmethod
    def config_options(cls, config) -> dict:
        return {"n_layers": len(config.datasets) or 1, "tied_decoders": config.clt_tied_decoders,
                "activation": config.clt_activation,
                "pooled_loss": config.clt_loss == "pooled"}  # fmt: skip

    @classmethod
    def stored_options(cls, metadata: dict) -> dict:
        def names(key):
            value = metadata.get(key) or "[]"
            return tuple(json.loads(value) if isinstance(value, str) else value)

        return {
            "n_layers": int(metadata["n_layers"]),
            "tied_decoders": str(metadata.get("tied_decoders", "false")).lower() == "true",
            "activation": metadata.get("activation", "topk"),
            "hook_points": names("hook_points"),
            "target_hook_points": names("target_hook_points"),
        }

    # --- latents -------------------------------------------------------------------------

    @property
    def latents_total(self) -> int:
        return self.n_layers * self.n_latents

    @property
    def target_blocks(self) -> int:
        return self.n_layers

    def local_latents(self, indices: torch.Tensor) -> torch.Tensor:
        layer = torch.div(indices, self.n_latents, rounding_mode="floor")
        within = indices - layer * self.n_latents - mesh_rank(self.mesh, MODEL) * self.n_layer_local
        return layer * self.n_layer_local + within

    def gather_latents(self, local: torch.Tensor) -> torch.Tensor:
        return _BY_LATENT.gather(local.view(self.n_layers, -1), self.mesh).flatten()

    def distribute_latents(self, full: torch.Tensor) -> torch.Tensor:
        return _BY_LATENT.distribute(full.view(self.n_layers, -1), self.mesh).flatten()

    def latent_groups(self) -> dict[str, slice]:
        n = self.n_latents
        return {
            f"layer{layer}": slice(layer * n, (layer + 1) * n) for layer in range(self.n_layers)
        }

    # --- the code ------------------------------------------------------------------------

    def split_inputs(self, x: torch.Tensor) -> list[torch.Tensor]:
        """``[B, L d_in]`` cut into the layers' ``[B, d_in]`` inputs."""
        if x.shape[-1] != self.n_layers * self.d:
            raise InvalidArgumentError(
                f"a CLT of {self.n_layers} layers of width {self.d} reads [B, {self.n_layers * self.d}], "
                f"got {list(x.shape)}"
            )
        return list(x.to(self.encoder_weight.dtype).split(self.d, dim=-1))

    def _candidates(self, k: int) -> int:
        cap = BATCH_TOPK_ROW_CAP if self.activation == "batchtopk" else 1
        return min(cap * k, self.n_layer_local)

    def _select(self, vals: torch.Tensor, k: int, batch: bool) -> torch.Tensor:
        """Zero the candidates ``[B, L, c]`` that lose their layer's selection: the top k
        per row, or (``batch``) the ``k B`` largest of the layer's batch."""
        tp = mesh_dim_size(self.mesh, MODEL)
        if tp == 1 and not batch and vals.shape[2] <= k:
            return vals  # the local top-k is the code
        cand = all_gather_cat(vals.detach(), self.mesh, MODEL, dim=2)  # [B, L, tp c]
        if batch:
            if tp > 1:  # the row cap over every rank's candidates, as on one process
                cap = min(BATCH_TOPK_ROW_CAP * k, self.n_latents)
                row_cut = cand.topk(cap, dim=2).values[:, :, -1:]
                cand, vals = cand * (cand >= row_cut), vals * (vals >= row_cut)
            flat = cand.transpose(0, 1).reshape(self.n_layers, -1)
            keep = min(k * vals.shape[0], flat.shape[1])
            cut = flat.topk(keep, dim=1, sorted=False).values.min(dim=1).values
            return vals * (vals >= cut.clamp_min(torch.finfo(vals.dtype).tiny)[None, :, None])
        win = torch.zeros_like(cand, dtype=torch.bool)
        win.scatter_(2, cand.topk(k, dim=2, sorted=False).indices, True)
        c, rank = vals.shape[2], mesh_rank(self.mesh, MODEL)
        return vals * win[:, :, rank * c : (rank + 1) * c]

    def forward(
        self,
        x: torch.Tensor,
        *,
        k: int | None = None,
        dead: torch.Tensor | None = None,
        k_aux: int = 0,
        aux_rows: int | None = None,
    ) -> SAEOutput:
        """Encode every layer of ``x [B, L d_in]`` and decode every target ``[B, L d_out]``.
        In training the activation's selection; in eval mode ``inference``'s rule (the top
        k per row, or the thresholds). ``dead`` (bool ``[n_local]``, layer-major) with
        ``k_aux`` also picks each layer's AuxK latents among its dead ones on the first
        ``aux_rows`` rows."""
        k = k or self.k
        use_aux = dead is not None and k_aux > 0
        k_aux = min(k_aux, self.n_layer_local) if use_aux else 0
        rows = len(x) if aux_rows is None else aux_rows
        if self.tuning_thresholds if self.training else self.inference == "threshold":
            return self._threshold_forward(x)
        c = self._candidates(k)
        dead_l = dead.view(self.n_layers, -1) if use_aux else None
        vals, idx, aux_vals, aux_idx = [], [], [], []
        for layer, x_l in enumerate(self.split_inputs(x)):
            v, i, av, ai = _TopKEncode.apply(
                copy_to_model(x_l, self.mesh), self.encoder_weight[layer],
                self.encoder_bias[layer], c, dead_l[layer] if use_aux else None, k_aux, rows,
            )  # fmt: skip
            vals.append(v), idx.append(i), aux_vals.append(av), aux_idx.append(ai)
        vals, idx = torch.stack(vals, 1), torch.stack(idx, 1)  # [B, L, c]
        vals = self._select(vals, k, batch=self.training and self.activation == "batchtopk")
        values, indices = vals.flatten(1), self._global(idx).flatten(1)
        if use_aux:
            av = self._select(torch.stack(aux_vals, 1), k_aux, batch=False)
            aux = (av.flatten(1), self._global(torch.stack(aux_idx, 1)).flatten(1))
        else:
            aux = (values[:, :0], indices[:, :0])
        return SAEOutput(self.decode(values, indices), values, indices, *aux)

    def _threshold_forward(self, x: torch.Tensor) -> SAEOutput:
        """The threshold code of ``x [B, L d_in]``, every latent above its threshold as
        ``encode_layer(rule="threshold")`` fires it (no cap on a row's latents), and its
        reconstruction. Each layer's code is decoded from its list of (row, latent, value)
        entries (a row's count varies, and a few rows fire hundreds); ``values`` /
        ``indices`` hold each layer's fired latents in as many slots as its busiest row
        needs (zeros after), detached. While the thresholds train, straight through
        (``ThresholdCode``): the entries also hold each row's latents within half the
        kernel's width below their thresholds (their gradient), kept for the L0 penalty
        (``sparsity_loss``)."""
        tuning = self.training and self.tuning_thresholds
        thetas = self.log_threshold.exp() if tuning else self.threshold
        B, L = len(x), self.n_layers
        out = x.new_zeros(B, L, self.d_out, dtype=self.decoder_bias.dtype)
        fired, self._tuned = [], [] if tuning else None
        w_enc, b_enc = self.encoder_weight, self.encoder_bias
        for layer, x_l in enumerate(self.split_inputs(x)):
            x_l, theta = copy_to_model(x_l, self.mesh), thetas[layer].to(w_enc.dtype)
            with torch.no_grad():
                pre = torch.addmm(b_enc[layer], x_l, w_enc[layer].t())
                reach = theta - self.bandwidth[layer].to(pre) / 2 if tuning else theta
                flat = (pre > reach).flatten().nonzero().squeeze(1)  # row-major
                rows, latents = flat // pre.shape[1], flat % pre.shape[1]
                counts = torch.bincount(rows, minlength=B)
                offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)[:-1]])
            v = EntryEncode.apply(x_l, w_enc[layer], b_enc[layer], rows, latents,
                                   pre.flatten()[flat])  # fmt: skip
            th = theta[latents]
            if tuning:
                eps = self.bandwidth[layer].to(v).expand_as(v)
                self._tuned.append((v.detach(), th, eps))
                code = ThresholdCode.apply(v, th, eps)
            else:
                code = v * (v > th)
            w = self.decoder_weights()[layer]
            part = F.embedding_bag(latents, w.flatten(1), offsets,
                                   per_sample_weights=code.to(w.dtype), mode="sum")  # fmt: skip
            out[:, layer:] += part.view(B, w.shape[1], self.d_out)  # tied: broadcast
            fired.append((rows, latents, code.detach(), offsets))
        x_hat = reduce_from_model(out.flatten(1), self.mesh) + self.decoder_bias.flatten()
        values, indices = self._slots(fired, B)
        return SAEOutput(x_hat, values, indices, values[:, :0], indices[:, :0])

    def _slots(self, fired, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(values, indices)`` ``[B, L m]`` (global indices, zeros after a row's own) of
        each layer's fired entries ``(rows, latents, values, offsets)``."""
        kept = [(r[v > 0], i[v > 0], v[v > 0]) for r, i, v, _ in fired]
        busiest = [int(torch.bincount(r, minlength=rows).max()) for r, _, _ in kept if len(r)]
        width = max([1, *busiest])
        values = fired[0][2].new_zeros(rows, self.n_layers, width)
        idx = torch.zeros(rows, self.n_layers, width, dtype=torch.long, device=values.device)
        for layer, (r, i, v) in enumerate(kept):
            counts = torch.bincount(r, minlength=rows)
            slot = torch.arange(len(r), device=r.device) - (counts.cumsum(0) - counts)[r]
            values[r, layer, slot], idx[r, layer, slot] = v, i
        return values.flatten(1), self._global(idx).flatten(1)

    def _global(self, idx: torch.Tensor) -> torch.Tensor:
        """Local indices ``[B, L, c]`` to global ``l n + i``."""
        layers = torch.arange(self.n_layers, device=idx.device)[None, :, None]
        return idx + layers * self.n_latents + mesh_rank(self.mesh, MODEL) * self.n_layer_local

    def decode_latents(self, values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """``[B, L d_out]``: every target's ``sum_{l <= t} z_l W_dec^{l->t}`` over every
        model rank, without ``decoder_bias``; ``(values, indices)`` ``[B, L m]`` as
        ``forward`` gives them."""
        B, L = values.shape[0], self.n_layers
        v, i = values.view(B, L, -1), self.local_latents(indices).view(B, L, -1)
        out = values.new_zeros(B, L, self.d_out, dtype=self.decoder_bias.dtype)
        for layer, w in enumerate(self.decoder_weights()):
            local = i[:, layer] - layer * self.n_layer_local
            part = F.embedding_bag(local, w.flatten(1), per_sample_weights=v[:, layer].to(w.dtype),
                                   mode="sum").view(B, w.shape[1], self.d_out)  # fmt: skip
            out[:, layer:] += part  # tied: one slot, broadcast to every target above
        return reduce_from_model(out.flatten(1), self.mesh)

    def decode(self, values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        return self.decode_latents(values, indices) + self.decoder_bias.flatten()

    def evaluation_parts(self, out: SAEOutput, y: torch.Tensor) -> dict:
        hats = out.x_hat.view(len(y), self.n_layers, -1)
        ys = y.view(len(y), self.n_layers, -1)
        return {f"layer{t}": (hats[:, t], ys[:, t]) for t in range(self.n_layers)}

    # --- inference, one layer at a time ----------------------------------------------------

    @torch.no_grad()
    def encode_layer(
        self, layer: int, x: torch.Tensor, *, rule: str = "topk", k: int | None = None
    ) -> torch.Tensor:
        """Layer ``layer``'s dense code ``[B, n]`` of its MLP input ``x [B, d_in]``: the
        top ``k`` of ``ReLU(W_enc x + b_enc)`` per row (``rule="topk"``, k = the trained
        k by default), or ``pre * 1[pre > threshold]`` (``rule="threshold"``). On a mesh
        every rank gets the whole code."""
        if rule not in self.INFERENCE:
            raise InvalidArgumentError(f"rule must be one of {self.INFERENCE}, got {rule!r}")
        x = x.to(self.encoder_weight.dtype)
        pre = torch.addmm(self.encoder_bias[layer], x, self.encoder_weight[layer].t())
        if rule == "threshold":
            local = pre * (pre > self.threshold[layer])
            return all_gather_cat(local, self.mesh, MODEL, dim=1)
        pre = all_gather_cat(pre.relu(), self.mesh, MODEL, dim=1)
        vals, idx = pre.topk(k or self.k, dim=1)
        return torch.zeros_like(pre).scatter_(1, idx, vals)

    def decode_layer(self, target: int, codes: Sequence[torch.Tensor]) -> torch.Tensor:
        """``y_hat_target [B, d_out] = sum_{l <= target} codes[l] W_dec^{l->target} +
        b_dec^target`` from the dense codes ``[B, n]`` of layers 0..target (more are
        ignored)."""
        if len(codes) <= target:
            raise InvalidArgumentError(
                f"decoding layer {target} needs the codes of layers 0..{target}, got {len(codes)}"
            )
        lo = mesh_rank(self.mesh, MODEL) * self.n_layer_local
        part = sum(
            codes[src][:, lo : lo + self.n_layer_local].to(self.decoder_bias.dtype)
            @ self.decoder(src, target)
            for src in range(target + 1)
        )
        return reduce_from_model(part, self.mesh) + self.decoder_bias[target]

    def forward_layers(
        self, xs: Sequence[torch.Tensor], *, rule: str = "topk"
    ) -> list[torch.Tensor]:
        """Every layer's ``y_hat_t`` from the layers' inputs ``xs`` (L tensors ``[B, d_in]``)."""
        codes = [self.encode_layer(layer, x, rule=rule) for layer, x in enumerate(xs)]
        return [self.decode_layer(t, codes) for t in range(len(xs))]

    # --- the threshold rule ----------------------------------------------------------------

    @torch.no_grad()
    def calibrate_thresholds(self, batches, k: int | None = None) -> None:
        """Set ``threshold`` by the module docstring's rule from ``batches`` (``x [B, L
        d_in]`` each, or ``(x, y)`` pairs with the targets ``y [B, L d_out]``; the same on
        every rank: a collective over "model"), selected as in training (the top k per
        row, or per batch for BatchTopK). Without targets, the frequency-matched
        thresholds alone."""
        was_training = self.training
        self.train()
        try:
            pairs = [b if isinstance(b, tuple | list) else (b, None) for b in batches]
            if not pairs:
                raise InvalidArgumentError("no rows to calibrate the CLT's thresholds on")
            dev = self.encoder_weight.device
            x = torch.cat([p[0] for p in pairs]).to(dev, self.encoder_weight.dtype)
            counts = torch.zeros(self.n_local, dtype=torch.long, device=self.threshold.device)
            for xb, _ in pairs:
                out = self(xb.to(dev, self.encoder_weight.dtype), k=k)
                counts += torch.bincount(self.local_latents(out.indices)[out.values > 0],
                                         minlength=self.n_local)  # fmt: skip
            xs = self.split_inputs(x)
            for layer in range(self.n_layers):
                c = counts.view(self.n_layers, -1)[layer]
                self.threshold[layer] = self._frequency_matched(layer, xs[layer], c)
            if all(p[1] is not None for p in pairs):
                y = torch.cat([p[1] for p in pairs]).to(dev, self.decoder_bias.dtype)
                self._refine_thresholds(x, y, counts, k)
            self.threshold_source = "calibrated"
        finally:
            self.train(was_training)

    def _code_and_error(self, x: torch.Tensor, y: torch.Tensor, rule: str, k: int | None):
        """The code of ``rule`` ("train": the training selection; "threshold") as each
        row's fired local latents ``[N, L, m]`` (within its layer; -1: none), and the
        weighted error ``(y - y_hat) * w`` ``[N, L, d_out]`` with its total ``sum w (y -
        y_hat)^2``."""
        fired, x_hat = [], torch.empty_like(y)
        self.train(rule == "train")
        inference, self.inference = self.inference, "threshold"
        try:  # in chunks of rows: the forward's temporaries stay small
            for lo in range(0, len(x), 2048):
                out = self(x[lo : lo + 2048], k=k)
                local = self.local_latents(out.indices).view(len(out.indices), self.n_layers, -1)
                local = (
                    local
                    - torch.arange(self.n_layers, device=local.device)[:, None] * self.n_layer_local
                )
                fired.append(local.masked_fill(out.values.view_as(local) <= 0, -1))
                x_hat[lo : lo + 2048] = out.x_hat
        finally:
            self.inference = inference
            self.train()
        width = max(f.shape[2] for f in fired)  # the threshold code's varies by chunk
        fired = [F.pad(f, (0, width - f.shape[2]), value=-1) for f in fired]
        ys = y.view(len(y), self.n_layers, -1)
        err = ys - x_hat.view_as(ys)
        var = (ys - ys.mean(0)).pow(2).sum((0, 2)).clamp_min(torch.finfo(ys.dtype).tiny)
        w = (1 / var.sum()).expand_as(var) if self.pooled_loss else 1 / var
        total = float((err.pow(2).sum((0, 2)) * w).sum())
        return torch.cat(fired), err * w[None, :, None], w, total

    def _refine_thresholds(self, x: torch.Tensor, y: torch.Tensor, counts, k) -> None:
        """Two rounds of the least-error rule (module docstring) from the frequency-matched
        thresholds, each layer held to the training code's firings on the rows
        (``counts``, this rank's latents); the thresholds of the three with the least
        weighted error on the rows are kept."""
        xs = self.split_inputs(x)
        budget = all_reduce(counts.view(self.n_layers, -1).sum(1), self.mesh, MODEL)
        code, werr, w, _ = self._code_and_error(x, y, "train", k)
        best = [self.threshold.clone()]
        errors = [self._code_and_error(x, y, "threshold", k)[3]]
        for _ in range(2):
            for layer in range(self.n_layers):
                gains = self._cut_gains(layer, xs[layer], code[:, layer], werr, w)
                rows = self._cuts_within(gains, int(budget[layer]))
                self.threshold[layer] = self._cut_thresholds(layer, xs[layer], rows)
            best.append(self.threshold.clone())
            code, werr, w, total = self._code_and_error(x, y, "threshold", k)
            errors.append(total)
        self.threshold.copy_(best[min(range(len(errors)), key=errors.__getitem__)])

    def _local_pre(self, layer: int, x: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        w = self.encoder_weight[layer, lo:hi]
        return torch.addmm(self.encoder_bias[layer, lo:hi], x, w.t())

    def _cut_gains(self, layer, x, code, werr, w) -> torch.Tensor:
        """``[N + 1, n_local]``: for each local latent of ``layer``, the summed gain of
        firing it on its j rows of largest pre-activation (j = 0..N), the rest of the code
        ``code`` (each row's fired latents of the layer, ``[N, m]``, -1: none; its own
        firing included) held. Firing latent i with value p on row r,
        its decoder rows D (to every target), lowers the weighted squared error by ``g_r =
        2 p <e_r, D>_w + (2 a_r - 1) p^2 |D|_w^2`` (e_r the row's weighted error, a_r
        whether the code fires it there); rows of p <= 0 cannot fire (gain 0)."""
        targets = range(layer, self.n_layers)
        dec = [self.decoder(layer, t) for t in targets]  # [n_local, d_out] each
        out = x.new_zeros(len(x) + 1, self.n_layer_local)
        for lo in range(0, self.n_layer_local, 64):
            hi = min(lo + 64, self.n_layer_local)
            pre = self._local_pre(layer, x, lo, hi)
            dot = sum(werr[:, t] @ d[lo:hi].t() for t, d in zip(targets, dec, strict=True))
            norm = sum(w[t] * d[lo:hi].pow(2).sum(1) for t, d in zip(targets, dec, strict=True))
            inside = (code >= lo) & (code < hi)
            fired = (
                pre.new_zeros(pre.shape)
                .scatter_add_(1, (code - lo).clamp(0, hi - lo - 1), inside.to(pre.dtype))
                .clamp_max(1)
            )
            gain = 2 * pre * dot + (2 * fired - 1) * pre.pow(2) * norm
            order = pre.sort(dim=0, descending=True)
            gains = gain.gather(0, order.indices).masked_fill(order.values <= 0, 0)
            out[1:, lo:hi] = gains.cumsum(0)
        return out

    def _cuts_within(self, gains: torch.Tensor, budget: int) -> torch.Tensor:
        """Each latent's number of rows ``j`` maximising ``gains[j] - lam j``, with the
        least ``lam >= 0`` (bisection) whose firings over the layer's latents (every
        rank's) stay within ``budget``: the least error at the training code's L0."""
        steps = torch.arange(len(gains), device=gains.device, dtype=gains.dtype)[:, None]

        def cuts(lam: float) -> tuple[torch.Tensor, int]:
            j = (gains - lam * steps).argmax(0)
            return j, int(all_reduce(j.sum(), self.mesh, MODEL))

        j, fired = cuts(0.0)
        if fired <= budget:
            return j
        hi = float(all_reduce(gains.diff(dim=0).max().clamp_min(0), self.mesh, MODEL, "max"))
        lo, best = 0.0, cuts(hi)[0]
        for _ in range(40):
            mid = (lo + hi) / 2
            j, fired = cuts(mid)
            if fired <= budget:
                hi, best = mid, j
            else:
                lo = mid
        return best

    def _cut_thresholds(self, layer: int, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The thresholds under which each local latent fires on its ``rows`` rows of
        largest pre-activation: midway between the ``rows``-th and the next (none: its
        largest)."""
        out = torch.empty(self.n_layer_local, device=x.device)
        for lo in range(0, self.n_layer_local, 64):
            hi = min(lo + 64, self.n_layer_local)
            ranked = self._local_pre(layer, x, lo, hi).sort(dim=0, descending=True).values
            ranked = torch.cat([ranked[:1], ranked, ranked.new_zeros(1, hi - lo)])
            j = rows[None, lo:hi]
            out[lo:hi] = ((ranked.gather(0, j) + ranked.gather(0, j + 1)) / 2)[0].clamp_min(0)
        return out

    def _frequency_matched(self, layer: int, x: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        """Each local latent's threshold above which ``count`` of its pre-activations on
        ``x`` lie (blocks of latents, so memory is ``N x 256`` at a time)."""
        out = torch.empty(self.n_layer_local, device=x.device)
        n_rows = len(x)
        for lo in range(0, self.n_layer_local, 256):
            w = self.encoder_weight[layer, lo : lo + 256]
            pre = torch.addmm(self.encoder_bias[layer, lo : lo + 256], x, w.t())
            ranked = pre.sort(dim=0, descending=True).values  # [N, blk]
            ranked = torch.cat([ranked[:1], ranked, ranked.new_zeros(1, ranked.shape[1])])
            c = count[lo : lo + 256].clamp(0, n_rows)[None]
            between = (ranked.gather(0, c) + ranked.gather(0, c + 1)) / 2
            out[lo : lo + 256] = between[0].clamp_min(0)
        return out

    # --- the thresholds' fine-tune -----------------------------------------------------------

    @property
    def tuning_thresholds(self) -> bool:
        """Whether a training forward encodes by the thresholds, straight through
        (``begin_threshold_training``)."""
        return "log_threshold" in self._parameters

    @torch.no_grad()
    def begin_threshold_training(self, bandwidth: float, l0_coef: float) -> None:
        """From here a training forward fires each latent above its threshold, with the
        rectangle-kernel pseudo-derivatives of ``jumprelu.py`` (module docstring: trained
        thresholds); the thresholds are trained as ``log_threshold`` (a parameter, sharded
        as ``threshold``) from their present values, the L0 penalty (``sparsity_loss``)
        holding each layer's L0 at ``k``. ``bandwidth``: the kernel's width as a fraction
        of each layer's median positive threshold (the same on every rank: a collective
        over "model")."""
        theta = self.threshold.float()
        positive = [row[row > 0] for row in all_gather_cat(theta, self.mesh, MODEL, dim=1)]
        median = torch.stack([r.median() if len(r) else r.new_ones(()) for r in positive])
        self.bandwidth = bandwidth * median  # [L]
        # a latent at threshold 0 fires on every positive pre-activation; its log
        # starts at the layer's floor, a thousandth of the median, where it fires alike
        floor = (median * 1e-3)[:, None]
        start = torch.maximum(theta, floor).log()
        self.register_parameter("log_threshold", torch.nn.Parameter(start))
        self.l0_coef, self.last_penalty, self._tuned = float(l0_coef), 0.0, None

    @torch.no_grad()
    def end_threshold_training(self) -> None:
        """Keep the trained thresholds (``threshold_source = "trained"``); a training
        forward selects by ``activation`` again."""
        self.threshold.copy_(self._parameters.pop("log_threshold").exp().to(self.threshold))
        self.bandwidth, self._tuned = None, None
        self.threshold_source = "trained"

    def sparsity_loss(self, out: SAEOutput) -> torch.Tensor | None:
        """While the thresholds train: a term whose gradient is that of ``l0_coef *
        sum_l (L0_l / k - 1)^2`` over the global batch once the data ranks' gradients are
        averaged (each layer's L0 all-reduced over "data" and "model", a constant; this
        rank's firing counts carry the gradient to its thresholds, as ``jumprelu.py``'s
        penalty does per layer); its value in ``last_penalty``. None otherwise."""
        if not self._tuned or not self.l0_coef:
            self._tuned = None
            return None
        counts = torch.stack([Fires.apply(*t).sum() for t in self._tuned])  # [L], this rank's
        rows = len(out.values)
        self._tuned = None
        stats = torch.cat([counts.detach().double(), counts.new_tensor([rows]).double()])
        all_reduce(stats, self.mesh, DATA)
        fired = all_reduce(stats[:-1].clone(), self.mesh, MODEL)
        rows = float(stats[-1])
        gap = fired / rows / self.k - 1  # [L]
        self.last_penalty = self.l0_coef * float(gap.pow(2).sum())
        slope = (2 * self.l0_coef / self.k) * gap  # d penalty / d L0_l
        return (counts * slope.to(counts)).sum() * (mesh_dim_size(self.mesh, DATA) / rows)

    # --- the trainer's hooks ---------------------------------------------------------------

    @torch.no_grad()
    def center_encoder(self, mean_x: torch.Tensor) -> None:
        """``input_mean = mean(x_l)`` per layer and ``b_enc^l = -W_enc^l mean(x_l)``
        (``mean_x``: ``[L d_in]`` or ``[L, d_in]``)."""
        self.input_mean.copy_(mean_x.reshape(self.n_layers, self.d).to(self.input_mean))
        self.encoder_bias.copy_(-self._encoder_shift())

    def _encoder_shift(self) -> torch.Tensor:
        return torch.einsum(
            "lnd,ld->ln", self.encoder_weight, self.input_mean.to(self.encoder_weight)
        )

    @torch.no_grad()
    def before_update(self) -> None:
        """The encoders' gradients about each layer's ``input_mean`` (``transcoder.py``):
        ``g_W -= g_b mu^T``; the decoders keep their norms."""
        w, b = self.encoder_weight, self.encoder_bias
        self._shift = None
        if w.grad is not None and b.grad is not None:
            w.grad.sub_(b.grad[:, :, None] * self.input_mean.to(w.grad)[:, None, :])
            self._shift = self._encoder_shift()

    @torch.no_grad()
    def after_update(self) -> None:
        """``b -= (W_new - W_old) mu``: each step keeps the encoder's centred form."""
        if self._shift is not None:
            self.encoder_bias.sub_(self._encoder_shift() - self._shift)
        self._shift = None

    # --- state ---------------------------------------------------------------------------

    def full_shapes(self) -> dict[str, tuple[int, ...]]:
        return clt_file_shapes(self.metadata())

    def local_state(self) -> dict[str, torch.Tensor]:
        state = {"encoder_weight": self.encoder_weight.detach(),
                 "encoder_bias": self.encoder_bias.detach()}  # fmt: skip
        for layer, w in enumerate(self.decoder_weights()):
            state[decoder_name(layer)] = w.detach()
        return state | {"decoder_bias": self.decoder_bias.detach(), "threshold": self.threshold}

    @torch.no_grad()
    def load_local_state(self, local: dict[str, torch.Tensor]) -> None:
        for name, value in local.items():
            if name == "threshold":
                self.threshold.copy_(value)
            elif name.startswith("decoder_weight."):
                getattr(self, f"decoder_weight_{name.split('.')[1]}").copy_(value)
            else:
                getattr(self, name).copy_(value)

    def metadata(self) -> dict[str, str]:
        return {
            "architecture": self.ARCHITECTURE,
            "activation": self.activation,
            "k": str(self.k),
            "n_layers": str(self.n_layers),
            "d_in": str(self.d),
            "d_out": str(self.d_out),
            "n_latents": str(self.n_latents),
            "tied_decoders": "true" if self.tied_decoders else "false",
            "hook_points": json.dumps(list(self.hook_points)),
            "target_hook_points": json.dumps(list(self.target_hook_points)),
            "blocks": json.dumps([block_of(h) for h in self.hook_points]),
        } | ({THRESHOLD_SOURCE: self.threshold_source} if self.threshold_source else {})
