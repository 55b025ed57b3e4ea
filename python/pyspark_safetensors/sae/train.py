"""Train an SAE (any registered architecture) on activations, on one process or a ("data", "model") mesh.

    torchrun --nproc-per-node=4 -m pyspark_safetensors.sae.train --config conf/sae.toml \\
        data_parallel_size=2 model_parallel_size=2

Every rank runs the same program. Ranks of one model group read the same batch (the
loader splits by the "data" coordinate only); gradients are averaged over "data"; the
loss is the FVU of the whole global batch, so DP=2 takes exactly the step one process
would take on the double batch. Side effects (logs, checkpoints, plots) happen on rank 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch

from ..format.errors import USER_ERRORS, InvalidArgumentError, PysparkSafetensorsError
from ..torch import ActivationLoader
from .architectures import (
    CrosscoderSAE,
    CrossLayerTranscoder,
    JumpReLUSAE,
    SparseAutoencoder,
    build_sae,
)
from .architectures.clt import THRESHOLD_SAMPLES
from .checkpoint import (
    CheckpointError,
    latest_checkpoint,
    read_checkpoint,
    save_sae,
    write_checkpoint,
)
from .config import SAEConfig
from .ecosystem import read_sae
from .evaluate import evaluate_sae
from .follow import following_loader, open_followed_source
from .mesh import (
    DATA,
    MODEL,
    all_gather_cat,
    all_reduce,
    barrier,
    exit_worker,
    is_main_process,
    make_mesh,
    mesh_dim_size,
    mesh_rank,
)
from .model import TINY, geometric_median
from .sinks import MetricSinks, check_sinks
from .sources import TrainingSource, open_source, open_training_source

SUMMARY_KEYS = ("step", "tokens", "fvu", "l0", "dead_fraction", "val_fvu", "val_l0",
                "val_dead_fraction", "val_dense_fraction")  # fmt: skip
#: The thresholds' fine-tune's log (``Trainer.train_thresholds``), beside ``metrics.jsonl``.
THRESHOLD_LOG = "thresholds.jsonl"
#: Rows of the initialisation sample that fit the encoder's starting scale (a scalar: a
#: few thousand tokens pin it; the forward pass costs a training step's half).
ENCODER_SCALE_SAMPLES = 4096


class NonFiniteLoss(PysparkSafetensorsError, FloatingPointError):
    """The loss became NaN or infinite; the last good state was checkpointed."""


@dataclasses.dataclass(frozen=True)
class _StepLosses:
    """One training step's loss and the global sums its metrics are made of."""

    loss: torch.Tensor
    """What this rank back-propagates: its share of the global FVU, x dp (gradients are
    averaged over "data"), plus AuxK's and the architecture's terms."""
    totals: torch.Tensor
    """float64 sums over "data": squared error, AuxK's squared error, firing latents on
    this rank's shard, the reconstruction term's squared error (Matryoshka: the prefixes'
    mean)."""
    l0_total: torch.Tensor
    """Firing latents summed over "data" and "model"."""
    var_x: torch.Tensor
    """Total variance of the global batch's targets (the FVU's normaliser)."""
    var_e: torch.Tensor
    """Total variance of AuxK's residual (its normaliser)."""
    n_tokens: torch.Tensor
    """Rows in the global batch."""
    d: int
    """Width of the targets."""
    use_aux: bool
    """AuxK contributed to this step's loss."""
    penalised: bool
    """The architecture added a sparsity term (its ``last_penalty`` is reported)."""
    block_variances: tuple[torch.Tensor, torch.Tensor] | None = None
    """When the loss sums the FVUs of several blocks of ``y`` (a cross-layer
    transcoder's layers): each block's variance and each block's AuxK residual variance
    (``[blocks]`` each); ``totals`` then continues with each block's squared error,
    reconstruction term and AuxK squared error."""
    pooled: bool = False
    """The blocks' errors are normalised together, by their total variance
    (``SAEConfig.clt_loss``), not each by its own."""


def _block_sums(t: torch.Tensor, blocks: int) -> torch.Tensor:
    """``[blocks]``: the sum of squares of each of ``t``'s equal column blocks."""
    if blocks == 1:
        return t.pow(2).sum()[None]
    return t.pow(2).view(len(t), blocks, -1).sum((0, 2))


def _block_metrics(losses: _StepLosses, aux_coef: float) -> dict[str, float]:
    """A loss of several blocks' FVUs (a CLT's layers): that loss, AuxK's, and each
    block's FVU (``fvu_layer<t>``)."""
    var_x, var_e = (v.clamp_min(TINY) for v in losses.block_variances)
    sq, recon, aux = losses.totals[4:].view(3, -1)
    norm_x, norm_e = (var_x.sum(), var_e.sum()) if losses.pooled else (var_x, var_e)
    aux_loss = float((aux / norm_e).sum()) if losses.use_aux else 0.0
    fvus = sq / var_x
    return {
        "loss": float((recon / norm_x).sum()) + aux_coef * aux_loss,
        "aux_loss": aux_loss,
        **{f"fvu_layer{t}": float(f) for t, f in enumerate(fvus)},
    }


def _device(choice: str) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise InvalidArgumentError("device='cuda' but CUDA is not available")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_run_dir(config: SAEConfig) -> None:
    """Refuse to mix two runs in one ``out_dir``: a directory holding a run's log or SAE
    is reused only to resume, or replaced with ``overwrite``."""
    out = Path(config.out_dir)
    previous = [
        n for n in ("metrics.jsonl", "sae.safetensors", "checkpoints") if (out / n).exists()
    ]
    if previous and not config.resume and not config.overwrite:
        raise InvalidArgumentError(
            f"out_dir {out} already holds a training run ({', '.join(previous)}); "
            "resume it (--resume auto), choose another --out-dir, or pass --overwrite"
        )


def _widths(source: TrainingSource, config: SAEConfig) -> tuple[int, int]:
    """The pairs' ``(d_in, d_out)``, checked against ``config.d`` and ``config.d_out``."""
    d_in, d_out = source.d_in, source.d_out
    if config.d and config.d != d_in:
        raise InvalidArgumentError(
            f"config d={config.d} but the dataset's {config.column!r} has width {d_in}"
        )
    if config.d_out and config.d_out != d_out:
        raise InvalidArgumentError(
            f"config d_out={config.d_out} but the target's {config.target_column!r} has width {d_out}"
        )
    return d_in, d_out


def _check_mesh(mesh, config: SAEConfig) -> None:
    data, model = mesh_dim_size(mesh, DATA), mesh_dim_size(mesh, MODEL)
    if (data, model) != (config.data_parallel_size, config.model_parallel_size):
        raise InvalidArgumentError(
            f"the mesh is data={data} x model={model}, "
            f"the config asks for {config.data_parallel_size} x {config.model_parallel_size}"
        )


def _held_out_source(config: SAEConfig, train: TrainingSource) -> TrainingSource | None:
    """The held-out pairs (None without any), of the training pairs' widths."""
    try:
        val = open_source(config, held_out=True)
    except InvalidArgumentError as e:
        raise InvalidArgumentError(f"val_dataset: {e}") from None
    shape = lambda s: (s.widths, s.target_widths, s.d_out)  # noqa: E731
    if val is not None and shape(val) != shape(train):
        raise InvalidArgumentError(
            f"val_dataset {config.val_dataset or list(config.val_datasets)}: column "
            f"{config.column!r} has rows of shape {list(val.widths)} (targets {val.d_out}), "
            f"the training data's rows are {list(train.widths)} (targets {train.d_out})"
        )
    return val


class Trainer:
    """One rank's share of a training run. ``train_step`` is one optimizer step on this
    rank's slice of the global batch; ``fit`` loops over the dataset with logging and
    checkpoints."""

    def __init__(self, config: SAEConfig, mesh=None):
        if not config.training_datasets:
            raise InvalidArgumentError(
                "config.dataset is empty: give the activation dataset directory"
            )
        check_run_dir(config)
        check_sinks(config.log_to)
        self.source = source = (
            open_followed_source(config) if config.follow else open_training_source(config)
        )
        self.dataset = ds = source.dataset
        d_in, d_out = _widths(source, config)
        self.config = config = dataclasses.replace(
            config, d=d_in, d_out=d_out, hook_point=config.hook_point or source.hook_points[0]
        )
        _check_mesh(mesh, config)
        self.val_source = _held_out_source(config, source)
        self.mesh = mesh
        self.val_frequency = None
        self.device = _device(config.device)
        self.dp = config.data_parallel_size
        self.sae = self._build_sae()
        encoder = [self.sae.encoder_weight]
        # a JumpReLU SAE's thresholds: a group of their own, at their own rate
        thresholds = [self.sae.log_threshold] if isinstance(self.sae, JumpReLUSAE) else []
        rest = [p for p in self.sae.parameters()
                if p is not self.sae.encoder_weight and all(p is not t for t in thresholds)]  # fmt: skip
        #: The encoder's learning rate relative to the rest's (``init_encoder_scale``).
        self.encoder_lr_scale = 1.0
        self.optimizer = torch.optim.Adam(
            # the encoder's group first, the thresholds' last
            [{"params": encoder}, {"params": rest}]
            + ([{"params": thresholds}] if thresholds else []),
            lr=config.learning_rate,  # each step sets its groups' rates (_schedule)
            betas=config.adam_betas,
            eps=config.adam_eps,
            # one fused kernel per step: on CPU 6x faster than the per-tensor loop at
            # 16,384 x 768 (a tenth of a step)
            fused=self.device.type in ("cpu", "cuda"),
        )
        self.loader = ActivationLoader(
            ds,
            config.batch_size // self.dp,
            columns=source.columns,
            seed=config.seed,
            drop_last=True,
            dp_rank=mesh_rank(mesh, DATA),
            dp_size=self.dp,
            num_workers=config.num_workers,
            pin_memory=self.device.type == "cuda",
        )
        per_epoch = len(self.loader)
        if per_epoch == 0:
            raise InvalidArgumentError(
                f"{config.dataset} has {len(ds)} rows, fewer than one global batch of "
                f"{config.batch_size}: lower batch_size"
            )
        self.total_steps = (config.tokens // config.batch_size if config.tokens else per_epoch) or 1
        if config.follow:  # the datasets as they grow, to the budget at most
            self.loader = following_loader(
                source, config, dp_rank=mesh_rank(mesh, DATA), dp_size=self.dp,
                max_samples=self.total_steps * config.batch_size,
            )  # fmt: skip
        self.warmup_steps = config.warmup_steps or round(config.warmup_fraction * self.total_steps)
        #: The peak learning rate of this run's length (``SAEConfig.learning_rate_at``).
        self.learning_rate = config.learning_rate_at(self.total_steps)
        self.dead_tokens = config.dead_window(self.total_steps * config.batch_size)
        self._warn_about_schedule()
        n_local = self.sae.n_local
        self.since_fired = torch.zeros(n_local, dtype=torch.long, device=self.device)
        self.fire_count = torch.zeros(n_local, dtype=torch.long, device=self.device)
        self.step = 0
        self.tokens_seen = 0
        self.history: list[dict] = []
        self.out_dir = Path(config.out_dir)

    def _build_sae(self) -> SparseAutoencoder:
        """A fresh SAE of ``config.architecture``, or the one ``init_from`` names (its shape
        must match)."""
        c = self.config
        sae = build_sae(c, mesh=self.mesh, device=self.device)
        if isinstance(sae, CrosscoderSAE):  # its blocks, named by its datasets
            sae.hook_points = self.source.hook_points
        if isinstance(sae, CrossLayerTranscoder):  # its layers, named by its datasets
            sae.hook_points = self.source.hook_points
            sae.target_hook_points = self.source.target_hook_points
        if c.init_from:
            tensors, _ = read_sae(c.init_from)
            if isinstance(sae, CrossLayerTranscoder):  # its load names any tensor that misfits
                sae.load_full_state(tensors)
                return sae
            got = (*tensors["encoder_weight"].shape, tensors["decoder_bias"].shape[0])
            if got != (c.latents, c.d, c.d_out):
                outputs = f" -> {got[2]} outputs" if got[2] != got[1] else ""
                raise InvalidArgumentError(
                    f"init_from {c.init_from}: an SAE of {got[0]} latents x {got[1]} inputs"
                    f"{outputs}; this run has n_latents={c.latents}, d={c.d}"
                    + (f", d_out={c.d_out}" if c.d_out != c.d else "")
                )
            if "threshold" in tensors:  # a ReLU SAE's 0 thresholds cannot move through log θ
                t = tensors["threshold"]
                tensors["threshold"] = torch.where(t > 0, t, c.jumprelu_init_threshold)
            sae.load_full_state(tensors)
        return sae

    # --- schedules -------------------------------------------------------------------------

    def _warn_about_schedule(self) -> None:
        decay = int(self.total_steps * self.config.decay_fraction)
        full = self.total_steps - self.warmup_steps - decay
        if (self.total_steps < 50 or full < 0.5 * self.total_steps) and is_main_process():
            warnings.warn(
                f"{self.config.out_dir}: the schedule leaves little room to train: "
                f"{self.total_steps} steps, of which {self.warmup_steps} warm up and {decay} "
                f"decay, {max(full, 0)} at the full learning rate; raise tokens or lower "
                "batch_size, warmup_steps or decay_fraction",
                stacklevel=3,
            )

    def lr_at(self, step: int) -> float:
        c = self.config
        warm = self.warmup_steps
        scale = min(1.0, (step + 1) / warm) if warm else 1.0
        decay_steps = int(self.total_steps * c.decay_fraction)
        if decay_steps and step >= self.total_steps - decay_steps:
            scale *= max(0.0, (self.total_steps - step) / decay_steps)
        return self.learning_rate * scale

    def k_at(self, step: int) -> int:
        c = self.config
        if not c.k_start:
            return c.k
        span = max(1, int(self.total_steps * c.k_anneal_fraction))
        frac = min(1.0, step / span)
        return max(1, round(c.k_start + (c.k - c.k_start) * frac))

    # --- initialisation from data ----------------------------------------------------------

    @torch.no_grad()
    def init_from_data(
        self,
        sample: torch.Tensor | None = None,
        inputs: torch.Tensor | None = None,
        *,
        fine_tune: bool = False,
    ) -> None:
        """Set ``decoder_bias`` from a sample of the targets (an SAE's: its activations),
        and a transcoder's ``input_mean`` and ``encoder_bias`` from the inputs' mean
        (``center_encoder``), each gathered over the data ranks (so every rank computes
        the same value); then a tied top-k SAE's encoder scale (``init_encoder_scale``)
        from the first ``ENCODER_SCALE_SAMPLES`` of the sample. ``sample`` / ``inputs``:
        this rank's rows; None = ``init_samples`` read from the data. ``fine_tune`` (an
        ``init_from`` run): only a transcoder's ``input_mean``, its weights kept."""
        c = self.config
        centers = hasattr(self.sae, "center_encoder")  # transcoders, CLTs
        if fine_tune and not centers:
            return
        if sample is None:
            rows = min(len(self.dataset), max(c.init_samples // self.dp, 1))
            rng = np.random.default_rng([c.seed, mesh_rank(self.mesh, DATA)])
            idx = np.sort(rng.choice(len(self.dataset), size=rows, replace=False))
            inputs, sample = self.source.read_pairs(idx)
        if centers and inputs is not None:
            x = all_gather_cat(inputs.to(self.device, torch.float32), self.mesh, DATA)
            if fine_tune:
                self.sae.input_mean.copy_(x.mean(0).view_as(self.sae.input_mean))  # a CLT's [L, d]
            else:
                self.sae.center_encoder(x.mean(0))
        if fine_tune:
            return
        sample = all_gather_cat(sample.to(self.device, torch.float32), self.mesh, DATA)
        if c.b_dec_init != "zeros":
            median = c.b_dec_init == "geometric_median"
            center = geometric_median(sample) if median else sample.mean(0)
            self.sae.decoder_bias.copy_(center.view_as(self.sae.decoder_bias))
        if self._fits_encoder_scale():
            self.init_encoder_scale(sample[:ENCODER_SCALE_SAMPLES])

    def _fits_encoder_scale(self) -> bool:
        """A tied encoder whose code the top-k picks (a scale leaves that choice alone)."""
        sae = self.sae
        return sae.TIED_INIT and sae.SELECTS_TOP_K and sae.d_out == sae.d

    @torch.no_grad()
    def init_encoder_scale(self, sample: torch.Tensor) -> float:
        """Scale the encoder (the decoder's transpose at init) so that the first
        reconstruction of ``sample`` (the same rows on every rank) has its least-squares
        size; returns the scale. The k rows the top-k picks for a token all lean towards
        it, so the sum of their projections counts the shared part about k times over: at
        d = 128, 4,096 latents and k = 32 the tied SAE's first FVU is above 1, and the
        first steps are spent shrinking it. Scaling the encoder keeps the top-k's choice
        and scales the code, so ``s = <x - b, x_hat - b> / |x_hat - b|^2`` (b the decoder
        bias) is exact; about 1 / (1 + 2 k ln(n / k) / d) on isotropic data.

        The encoder's learning rate is scaled with it: Adam's steps have the same size
        whatever the weights' scale, so a smaller encoder would move further relative to
        its size and its latents drift out of the top-k for good (at d = 128, 4,096
        latents, 256 steps: 8.1 % dead and FVU 0.138 with the unscaled rate, 1.4 % and
        0.124 with the scaled one)."""
        b = self.sae.decoder_bias.float()
        x = sample.to(self.device, torch.float32)
        x_hat = self.sae(x).x_hat.float()
        num = ((x - b) * (x_hat - b)).sum()
        den = (x_hat - b).pow(2).sum()
        scale = float(num / den) if float(den) > TINY else 1.0
        if math.isfinite(scale) and scale > 0:
            self.sae.encoder_weight.mul_(scale)
            self.encoder_lr_scale = scale
        return scale

    # --- one step ------------------------------------------------------------------------

    def train_step(self, x: torch.Tensor, y: torch.Tensor | None = None) -> dict[str, float]:
        """One optimizer step on this rank's pairs ``x [B_local, d_in]``, ``y [B_local,
        d_out]`` (None: ``y`` is ``x``, an SAE); returns global metrics. The loss is the
        FVU of ``y`` over the global batch (Matryoshka: the mean of its prefixes' FVUs)."""
        autoencoder = y is None or y is x
        x = x.to(self.device, torch.float32)
        y = x if autoencoder else y.to(self.device, torch.float32)
        k, lr = self._schedule()
        dead, n_dead = self._dead_latents()
        use_aux = n_dead > 0 and self.config.aux_coef > 0
        out, err, residual, aux_err = self._forward(x, y, k, dead if use_aux else None, n_dead)
        losses = self._losses(out, y, err, residual, aux_err)
        fvu = float(losses.totals[0] / losses.var_x)
        if not math.isfinite(fvu):
            raise NonFiniteLoss(f"non-finite loss at step {self.step} (FVU {fvu})")
        grad_norm = self._update(losses.loss)
        self._track_firing(out.values, out.indices, int(losses.n_tokens))
        self.step += 1
        self.tokens_seen += int(losses.n_tokens)
        return self._step_metrics(losses, fvu, grad_norm, lr, k)

    def _schedule(self) -> tuple[int, float]:
        """This step's ``k`` and learning rate, the latter set on the optimizer's groups
        (the encoder's scaled by ``encoder_lr_scale``)."""
        k = self.k_at(self.step)
        lr = self.lr_at(self.step)
        encoder, rest, *thresholds = self.optimizer.param_groups
        encoder["lr"], rest["lr"] = lr * self.encoder_lr_scale, lr
        for group in thresholds:  # the same schedule at the thresholds' rate
            group["lr"] = lr * self.config.threshold_learning_rate / self.learning_rate
        return k, lr

    def _dead_latents(self) -> tuple[torch.Tensor, int]:
        """This rank's mask of dead latents (unfired for ``dead_tokens``) and how many are
        dead over the whole SAE (a collective over "model")."""
        dead = self.since_fired >= self.dead_tokens
        return dead, int(all_reduce(dead.sum(), self.mesh, MODEL).item())

    def _forward(
        self, x: torch.Tensor, y: torch.Tensor, k: int, dead: torch.Tensor | None, n_dead: int
    ):
        """The SAE's forward pass (under bf16 autocast on CUDA when ``config.autocast``):
        its output, the error ``x_hat - y``, the residual AuxK is asked to explain (minus
        the detached error on this rank's first ``aux_rows`` rows) and AuxK's error on it
        (None when ``dead`` is None: no AuxK this step)."""
        c, sae = self.config, self.sae
        # AuxK on this rank's share of the first aux_rows rows; past n_dead latents its
        # top-k would only pick zeros
        aux_rows = -(-c.aux_rows // self.dp) if c.aux_rows else len(x)
        amp = (
            torch.autocast("cuda", dtype=torch.bfloat16)
            if c.autocast and self.device.type == "cuda"
            else nullcontext()
        )
        aux_err = None
        with amp:
            out = sae(x, k=k, dead=dead, k_aux=min(c.aux_k, n_dead), aux_rows=aux_rows)
            err = out.x_hat.float() - y
            residual = -err.detach()[:aux_rows]  # what the dead latents are asked to explain
            if dead is not None:
                aux_err = sae.decode_latents(out.aux_values, out.aux_indices).float() - residual
        return out, err, residual, aux_err

    def _losses(
        self,
        out,
        y: torch.Tensor,
        err: torch.Tensor,
        residual: torch.Tensor,
        aux_err: torch.Tensor | None,
    ) -> _StepLosses:
        """The loss this rank back-propagates (reconstruction FVU, AuxK's, the
        architecture's sparsity term) and the global sums the step's metrics are made of
        (collectives over "data", then "model")."""
        c, sae = self.config, self.sae
        blocks = sae.target_blocks  # a CLT: its layers' errors, normalised as clt_loss says
        var_x, var_e, n_tokens = self._global_variances(y, residual, blocks)
        sq = _block_sums(err, blocks)
        # a CLT's pooled loss (clt_loss): every layer's error over the layers' total variance
        pooled = blocks > 1 and c.clt_loss == "pooled"
        norm_x, norm_e = (var_x.sum(), var_e.sum()) if pooled else (var_x, var_e)
        # x dp: gradients are averaged over the data ranks, so each rank's share of the
        # global FVU is scaled up by dp.
        scale = self.dp / norm_x.clamp_min(TINY).float()
        recon_sq = sq  # what the loss's reconstruction term sums
        if out.x_hats:  # Matryoshka: every prefix's FVU, averaged (the last is x_hat)
            recon_sq = sum(_block_sums(h.float() - y, blocks) for h in out.x_hats) / len(out.x_hats)
        loss = (recon_sq * scale).sum()
        aux_sq = torch.zeros(blocks, device=self.device)
        if aux_err is not None:
            aux_sq = _block_sums(aux_err, blocks)
            loss = loss + (c.aux_coef * aux_sq * (self.dp / norm_e.clamp_min(TINY).float())).sum()
        sparsity = sae.sparsity_loss(out)
        if sparsity is not None:
            loss = loss + sparsity
        sae.after_forward()
        l0 = (out.values > 0).sum()
        parts = (sq.detach(), recon_sq.detach(), aux_sq.detach())
        totals = torch.cat([torch.stack([sq.detach().sum().double(), aux_sq.detach().sum().double(),
                                         l0.double(), recon_sq.detach().sum().double()]),
                            *(p.double() for p in parts if blocks > 1)])  # fmt: skip
        all_reduce(totals, self.mesh, DATA)
        l0_total = all_reduce(totals[2:3].clone(), self.mesh, MODEL)[0]
        per_block = (var_x, var_e) if blocks > 1 else None
        return _StepLosses(loss, totals, l0_total, var_x.sum(), var_e.sum(), n_tokens,
                           y.shape[1], aux_err is not None, sparsity is not None,
                           per_block, pooled)  # fmt: skip

    def _update(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer | None = None) -> float:
        """Back-propagate ``loss`` and take the optimizer's step (``optimizer``: the
        training's by default): gradients averaged over "data", the architecture's hooks
        around the update, global-norm clipping; returns the gradient norm before
        clipping."""
        optimizer = optimizer or self.optimizer
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self._sync_gradients()
        self.sae.before_update()
        grad_norm = self._clip_gradients()
        optimizer.step()
        self.sae.after_update()
        return grad_norm

    def _step_metrics(
        self, losses: _StepLosses, fvu: float, grad_norm: float, lr: float, k: int
    ) -> dict[str, float]:
        """The metrics ``train_step`` returns, after the step (``dead_fraction`` counts the
        latents dead now: a collective over "model")."""
        c, t, n_tokens = self.config, losses.totals, losses.n_tokens
        var_x, var_e, use_aux = losses.var_x, losses.var_e, losses.use_aux
        extra = {"l0_penalty": self.sae.last_penalty} if losses.penalised else {}
        if losses.block_variances is not None:  # the loss: its blocks' FVUs summed
            extra |= _block_metrics(losses, c.aux_coef)
        return {
            "step": self.step,
            "tokens": self.tokens_seen,
            "loss": float(t[3] / var_x + c.aux_coef * (t[1] / var_e if use_aux else 0)),
            "fvu": fvu,
            "mse": float(t[0] / (n_tokens * losses.d)),
            "aux_loss": float(t[1] / var_e) if use_aux else 0.0,
            "l0": float(losses.l0_total / n_tokens),
            "dead_fraction": self._dead_latents()[1] / self.sae.latents_total,
            "grad_norm": grad_norm,
            "lr": lr,
            "k": k,
        } | extra

    def _global_variances(self, x: torch.Tensor, e: torch.Tensor, blocks: int = 1):
        """Total variance of the global batch ``x`` and of the residual ``e`` (the FVU's and
        AuxK's normalisers, each over its own rows; ``[blocks]`` each: of each of
        ``blocks`` equal column blocks) and the global token count, in one collective."""
        if blocks > 1:
            return self._block_variances(x, e, blocks)
        var_x, var_e, n_tokens = self._whole_variances(x, e)
        return var_x.reshape(1), var_e.reshape(1), n_tokens

    def _block_variances(self, x: torch.Tensor, e: torch.Tensor, blocks: int):
        """``_global_variances`` of each column block (a CLT's layers)."""
        d = x.shape[1]
        stats = torch.cat([x.sum(0), _block_sums(x, blocks), e.sum(0), _block_sums(e, blocks)])
        stats = torch.cat([stats.double(), stats.new_tensor([x.shape[0], e.shape[0]]).double()])
        all_reduce(stats, self.mesh, DATA)
        n_tokens, n_aux = stats[-2], stats[-1]
        var_x = stats[d : d + blocks] - stats[:d].pow(2).view(blocks, -1).sum(1) / n_tokens
        e_sums = stats[d + blocks : 2 * d + blocks]
        var_e = stats[2 * d + blocks : -2] - e_sums.pow(2).view(blocks, -1).sum(1) / n_aux
        return var_x, var_e, n_tokens

    def _whole_variances(self, x: torch.Tensor, e: torch.Tensor):
        stats = torch.cat([x.sum(0), (x * x).sum()[None], e.sum(0), (e * e).sum()[None]]).double()
        stats = torch.cat([stats, stats.new_tensor([x.shape[0], e.shape[0]])])
        all_reduce(stats, self.mesh, DATA)
        d = x.shape[1]
        n_tokens, n_aux = stats[-2], stats[-1]
        var_x = stats[d] - stats[:d].pow(2).sum() / n_tokens
        var_e = stats[2 * d + 1] - stats[d + 1 : 2 * d + 1].pow(2).sum() / n_aux
        return var_x, var_e, n_tokens

    def _sync_gradients(self) -> None:
        """Average every gradient over "data" (one collective). A replicated parameter
        (``decoder_bias``, ``skip_weight``) has the same gradient on every model rank:
        it enters the loss after the model ranks' reduction, once."""
        if self.dp == 1:
            return
        params = [p for p in self.sae.parameters() if p.grad is not None]
        flat = torch.cat([p.grad.flatten() for p in params])
        all_reduce(flat, self.mesh, DATA, op="mean")
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
            offset += p.numel()

    def _clip_gradients(self) -> float:
        """Clip by the norm of the whole (gathered) gradient: sharded parameters' squares
        are summed over "model", the replicated ones (decoder bias, skip weight) counted
        once."""
        squares = {True: torch.zeros((), dtype=torch.float64, device=self.device), False: 0}
        for name, p in self.sae.named_parameters():
            if p.grad is not None:
                sharded = bool(self.sae.placement(name).dims)
                # the norm in the gradient's precision (a float64 copy of each gradient
                # cost a tenth of a CPU step), its square summed in float64
                norm = torch.linalg.vector_norm(p.grad).double()
                squares[sharded] = squares[sharded] + norm * norm
        sharded = all_reduce(squares[True], self.mesh, MODEL)
        replicated = squares[False]
        # math.sqrt: torch's sqrt is MKL's vector maths, whose bits differ between CPUs
        norm = math.sqrt(float(sharded + replicated))
        if self.config.grad_clip and norm > self.config.grad_clip:
            scale = self.config.grad_clip / (norm + 1e-6)
            for p in self.sae.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
        return norm

    @torch.no_grad()
    def _track_firing(self, values: torch.Tensor, indices: torch.Tensor, n_tokens: int) -> None:
        local = self.sae.local_latents(indices)[values > 0]
        fired = torch.bincount(local, minlength=self.sae.n_local)
        all_reduce(fired, self.mesh, DATA)
        self.fire_count += fired
        self.since_fired = torch.where(fired > 0, 0, self.since_fired + n_tokens)

    def evaluate_held_out(self, rule: str = "") -> dict[str, float]:
        """``val_*`` metrics on the held-out pairs ({} without any); keeps the per-latent
        frequencies for the plots (collective on every rank). ``rule`` "threshold": a
        cross-layer transcoder's code by its JumpReLU thresholds (``val_threshold_*``; the
        plots keep the top-k code's frequencies)."""
        c = self.config
        if self.val_source is None:
            return {}
        batches = self.val_source.batches(tokens=c.val_tokens, batch=c.batch_size)
        if rule:
            inference, self.sae.inference = self.sae.inference, rule
            try:
                result = evaluate_sae(self.sae, batches, self.mesh)
            finally:
                self.sae.inference = inference
            result.pop("frequency")
            return {f"val_{rule}_{k}": v for k, v in result.items()}
        result = evaluate_sae(self.sae, batches, self.mesh)
        self.val_frequency = result.pop("frequency")
        return {f"val_{k}": v for k, v in result.items()}

    # --- the thresholds' fine-tune (a cross-layer transcoder's) --------------------------

    def threshold_steps(self) -> int:
        """Steps of the thresholds' fine-tune after the top-k training: a cross-layer
        transcoder's ``clt_threshold_fraction`` of ``total_steps`` (at least one) when
        ``clt_thresholds = "trained"``; 0 otherwise."""
        c = self.config
        if not hasattr(self.sae, "begin_threshold_training") or c.clt_thresholds != "trained":
            return 0
        return max(1, round(self.total_steps * c.clt_threshold_fraction))

    def train_thresholds(self, sinks=None) -> dict[str, float]:
        """The thresholds' fine-tune (``architectures/clt.py``, trained thresholds):
        from the frequency-matched thresholds, ``threshold_steps`` steps on training batches (a
        pass of the loader of its own, seeded ``seed + 1``) of the reconstruction loss of
        the threshold code, straight through, plus the L0 penalty holding each layer at
        ``k``; the log thresholds at ``clt_threshold_lr``, the dictionary at
        ``clt_threshold_dictionary_lr`` of the learning rate, both warmed up and decayed as
        the training's rate. Logged to ``thresholds.jsonl`` (``THRESHOLD_LOG``; its last
        line the held-out metrics after it), ``metrics.jsonl`` staying the training's.
        Returns the held-out metrics after it, the top-k code's (``val_*``) and the
        threshold code's (``val_threshold_*``); {} when there is nothing to do (not a CLT,
        ``clt_thresholds = "calibrated"``, or its thresholds trained already, a run
        resumed from its last checkpoint). Collective on every rank."""
        c, sae = self.config, self.sae
        steps = self.threshold_steps()
        if not steps or sae.threshold_source == "trained":
            return {}
        # the start: each latent firing as often as the top-k fired it (L0 = k); the
        # least-error cut fires fewer, and the first steps went to climbing back
        self.calibrate(least_error=False)
        sae.begin_threshold_training(c.clt_threshold_bandwidth, c.l0_coef)
        optimizer, frozen = self._threshold_optimizer()
        source = open_training_source(c) if c.follow else self.source  # every row by now
        loader = ActivationLoader(
            source.dataset, c.batch_size // self.dp, columns=source.columns, seed=c.seed + 1,
            drop_last=True, dp_rank=mesh_rank(self.mesh, DATA), dp_size=self.dp,
            num_workers=c.num_workers, pin_memory=self.device.type == "cuda",
        )  # fmt: skip
        main = is_main_process()
        log_path = self.out_dir / THRESHOLD_LOG
        if main:
            log_path.write_text("")  # a resumed run's fine-tune starts over
        bar = _progress(steps, 0, enabled=main and c.progress, desc="thresholds")
        try:
            for step, batch in zip(range(steps), _endless(loader), strict=False):
                metrics = self._threshold_step(*source.pair(batch), optimizer, step, steps)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(fvu=f"{metrics['fvu']:.3f}", l0=f"{metrics['l0']:.1f}")
                if main and ((step + 1) % c.log_every == 0 or step + 1 == steps):
                    with open(log_path, "a") as log:
                        log.write(json.dumps(metrics) + "\n")
                    if sinks is not None:  # after the training's steps
                        sinks.log({f"thresholds/{k}": v for k, v in metrics.items()},
                                  self.step + step + 1)  # fmt: skip
        finally:
            if bar is not None:
                bar.close()
            sae.end_threshold_training()
            for p in frozen:
                p.requires_grad_(True)
        held_out = self.evaluate_held_out() | self.evaluate_held_out(rule="threshold")
        if main and held_out:
            with open(log_path, "a") as log:
                log.write(json.dumps({"threshold_step": steps} | held_out) + "\n")
        return held_out

    def _threshold_optimizer(self) -> tuple[torch.optim.Optimizer, list[torch.Tensor]]:
        """The fine-tune's Adam: the log thresholds at ``clt_threshold_lr``; the encoder
        and the rest of the dictionary at ``clt_threshold_dictionary_lr`` of the learning
        rate (the encoder's scaled as in training), or, at 0, frozen (returned, to thaw)."""
        c, sae = self.config, self.sae
        groups = [{"params": [sae.log_threshold], "lr": c.clt_threshold_lr}]
        dictionary = [p for n, p in sae.named_parameters() if n != "log_threshold"]
        lr = c.clt_threshold_dictionary_lr * self.learning_rate
        if lr:
            rest = [p for p in dictionary if p is not sae.encoder_weight]
            groups += [{"params": [sae.encoder_weight], "lr": lr * self.encoder_lr_scale},
                       {"params": rest, "lr": lr}]  # fmt: skip
            frozen = []
        else:
            frozen = [p for p in dictionary if p.requires_grad]
            for p in frozen:
                p.requires_grad_(False)
        for group in groups:
            group["base_lr"] = group["lr"]
        optimizer = torch.optim.Adam(groups, betas=c.adam_betas, eps=c.adam_eps,
                                     fused=self.device.type in ("cpu", "cuda"))  # fmt: skip
        return optimizer, frozen

    def _threshold_step(self, x, y, optimizer, step: int, steps: int) -> dict[str, float]:
        """One step of the fine-tune on this rank's pairs; its metrics (``threshold_step``
        and the training step's; ``l0`` the threshold code's, every layer's)."""
        c = self.config
        warm = round(c.warmup_fraction * steps)
        decay = int(c.decay_fraction * steps)
        scale = min(1.0, (step + 1) / warm) if warm else 1.0
        if decay and step >= steps - decay:
            scale *= max(0.0, (steps - step) / decay)
        for group in optimizer.param_groups:
            group["lr"] = group["base_lr"] * scale
        x = x.to(self.device, torch.float32)
        y = y.to(self.device, torch.float32)
        out, err, residual, _ = self._forward(x, y, c.k, None, 0)
        losses = self._losses(out, y, err, residual, None)
        fvu = float(losses.totals[0] / losses.var_x)
        if not math.isfinite(fvu):
            raise NonFiniteLoss(f"non-finite loss at step {step} of the thresholds' fine-tune")
        grad_norm = self._update(losses.loss, optimizer)
        metrics = self._step_metrics(losses, fvu, grad_norm, optimizer.param_groups[0]["lr"], c.k)
        return {"threshold_step": step + 1} | metrics

    # --- state -----------------------------------------------------------------------------

    def trainer_state(self) -> dict:
        """Everything beyond the SAE needed to continue exactly, gathered to full shapes
        (a collective: call on every rank)."""
        optimizer = {}
        for name, p in self.sae.named_parameters():
            st, place = self.optimizer.state.get(p, {}), self.sae.placement(name)
            if st:
                optimizer[name] = {
                    "step": st["step"].detach().cpu().clone(),
                    "exp_avg": place.gather(st["exp_avg"], self.mesh).cpu(),
                    "exp_avg_sq": place.gather(st["exp_avg_sq"], self.mesh).cpu(),
                }
        return {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "loader": self.loader.state_dict(),
            "optimizer": optimizer,
            "since_fired": self.sae.gather_latents(self.since_fired).cpu(),
            "fire_count": self.sae.gather_latents(self.fire_count).cpu(),
            "rng": torch.get_rng_state(),
            "encoder_lr_scale": self.encoder_lr_scale,
            "buffers": {n: b.detach().cpu().clone() for n, b in self.sae.named_buffers()},
            "config_hash": self.config.config_hash(),
            # a CLT's thresholds: trained ones are not calibrated again on resume
            "threshold_source": getattr(self.sae, "threshold_source", None),
        }

    @torch.no_grad()
    def load(self, checkpoint_dir: str | Path) -> None:
        """Continue from a checkpoint written by ``save`` (any mesh shape)."""
        tensors, state, config = read_checkpoint(checkpoint_dir)
        saved = SAEConfig.from_dict({**config, "adam_betas": tuple(config["adam_betas"])})
        if self.config.tokens >= saved.tokens:  # a resumed run may be given more tokens
            saved = dataclasses.replace(saved, tokens=self.config.tokens)
        if saved.config_hash() != self.config.config_hash():
            diff = {
                k: (v, getattr(self.config, k))
                for k, v in dataclasses.asdict(saved).items()
                if getattr(self.config, k) != v
            }
            raise CheckpointError(
                f"{checkpoint_dir}: written by a different training config; differences {diff}"
            )
        self.sae.load_full_state(tensors)
        by_name = dict(self.sae.named_parameters())
        fused = self.optimizer.defaults["fused"]  # a fused Adam keeps its step beside p
        for name, st in state["optimizer"].items():
            p, place = by_name[name], self.sae.placement(name)
            self.optimizer.state[p] = {
                "step": st["step"].clone().to(p.device if fused else "cpu"),
                "exp_avg": place.distribute(st["exp_avg"], self.mesh).to(p).clone(),
                "exp_avg_sq": place.distribute(st["exp_avg_sq"], self.mesh).to(p).clone(),
            }
        self.since_fired = self.sae.distribute_latents(state["since_fired"]).to(self.device).clone()
        self.fire_count = self.sae.distribute_latents(state["fire_count"]).to(self.device).clone()
        buffers = dict(self.sae.named_buffers())
        saved = state.get("buffers", {})
        if "threshold" in state and "threshold" in buffers:  # BatchTopK's, before "buffers"
            saved = {"threshold": state["threshold"], **saved}
        for name, value in saved.items():
            buffers[name].copy_(value)
        self.loader.load_state_dict(state["loader"])
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]
        self.encoder_lr_scale = state.get("encoder_lr_scale", 1.0)  # older runs: unscaled
        if hasattr(self.sae, "threshold_source"):  # trained: the file's as they are, unless
            # the run goes on (a resume given more tokens), to be calibrated and trained again
            done = self.step >= self.total_steps
            self.sae.threshold_source = state.get("threshold_source") if done else None
        torch.set_rng_state(state["rng"])
        self._truncate_metrics()

    def _truncate_metrics(self) -> None:
        """Keep the log lines up to the checkpoint's step: the killed run's later lines
        would otherwise stay in ``metrics.jsonl`` beside the resumed run's (rank 0
        rewrites the file; every rank keeps the same history)."""
        path = self.out_dir / "metrics.jsonl"
        if not path.is_file():
            return
        lines = []
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                break  # a line cut short by the kill; nothing after it is trusted
            if record.get("step", 0) > self.step:
                break
            lines.append((line, record))
        self.history = [r for _, r in lines]
        if is_main_process():
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text("".join(line + "\n" for line, _ in lines))
            os.replace(tmp, path)

    def sae_metadata(self, metrics: dict | None = None) -> dict:
        c = self.config
        return {
            "config_hash": c.config_hash(),
            "hook_point": c.hook_point,
            **self._family_metadata(),
            "d": str(c.d),
            "n_latents": str(c.latents),
            "k": str(c.k),
            **self.sae.metadata(),
            "step": str(self.step),
            "tokens": str(self.tokens_seen),
            "dataset_metadata": dict(self.dataset.metadata),
            **({"metrics": metrics} if metrics else {}),
        }

    def _family_metadata(self) -> dict:
        """A transcoder's ``target_hook_point`` (a crosscoder's ``hook_points`` are its
        architecture's metadata)."""
        if self.source.target:
            return {"target_hook_point": self.source.target_hook_point}
        return {}

    def save(self, metrics: dict | None = None) -> Path:
        """Checkpoint ``out_dir/checkpoints/step-NNNNNNNN`` (collective; rank 0 writes)."""
        self.calibrate()
        tensors = self.sae.full_state()
        state = self.trainer_state()
        path = self.out_dir / "checkpoints" / f"step-{self.step:08d}"
        if is_main_process():
            write_checkpoint(
                path, tensors, state, self.config.to_dict(), self.sae_metadata(metrics)
            )
        barrier()
        return path

    @torch.no_grad()
    def calibrate(self, *, least_error: bool = True) -> None:
        """A cross-layer transcoder's inference thresholds, from its training selection and
        reconstruction error on the first ``THRESHOLD_SAMPLES`` training rows and their
        targets (every rank reads the same; the rule is ``architectures/clt.py``'s;
        without ``least_error``, frequency matching alone: the inputs only); nothing for
        the other architectures, nor for thresholds trained already."""
        calibrate = getattr(self.sae, "calibrate_thresholds", None)
        if calibrate is None or self.sae.threshold_source == "trained":
            return  # trained thresholds (train_thresholds) are the file's as they are
        rows = min(len(self.source), THRESHOLD_SAMPLES)
        batches = self.source.batches(tokens=rows, batch=self.config.batch_size)
        pairs = [(x.to(self.device, torch.float32), y.to(self.device, torch.float32))
                 for x, y in batches]  # fmt: skip
        calibrate(pairs if least_error else [x for x, _ in pairs], k=self.k_at(self.step))

    def checkpoint_steps(self) -> set[int]:
        n = self.config.checkpoints
        if n == 0:
            return set()
        steps = np.geomspace(max(1, self.total_steps / 2**n), self.total_steps, n + 1)[:-1]
        return {int(s) for s in np.round(steps)} - {self.total_steps}

    # --- the loop --------------------------------------------------------------------------

    def _data_ended(self) -> bool:
        """Whether followed datasets are complete and every batch of them was trained on
        (the run then ends before ``tokens``; every rank learns it at the same step)."""
        return self.config.follow and self.loader.finished

    def fit(self) -> dict:
        """Train to ``total_steps``; returns the last metrics. Writes ``metrics.jsonl``,
        checkpoints, ``sae.safetensors`` and plots under ``out_dir`` (rank 0)."""
        c = self.config
        main = is_main_process()
        if main:
            if c.overwrite and not c.resume and self.step == 0:
                for name in ("metrics.jsonl", THRESHOLD_LOG, "sae.safetensors"):
                    (self.out_dir / name).unlink(missing_ok=True)
                shutil.rmtree(self.out_dir / "checkpoints", ignore_errors=True)
            self.out_dir.mkdir(parents=True, exist_ok=True)
            (self.out_dir / "config.json").write_text(
                json.dumps(c.to_dict(), indent=2, sort_keys=True) + "\n"
            )
        if self.step == 0:
            self.init_from_data(fine_tune=bool(c.init_from))
        bar = _progress(self.total_steps, self.step, enabled=main and c.progress)
        sinks = MetricSinks(c.log_to, self.out_dir, c.to_dict()) if main and c.log_to else None
        ckpt_steps = self.checkpoint_steps()
        metrics: dict = dict(self.history[-1]) if self.history else {}
        started, tokens_at_start = time.perf_counter(), self.tokens_seen
        try:
            while self.step < self.total_steps and not self._data_ended():
                for batch in self.loader:
                    try:
                        metrics = self.train_step(*self.source.pair(batch))
                    except NonFiniteLoss as e:
                        path = self.save()
                        raise NonFiniteLoss(f"{e}; last good state saved to {path}") from None
                    elapsed = time.perf_counter() - started
                    metrics["tokens_per_s"] = (self.tokens_seen - tokens_at_start) / elapsed
                    last = self.step == self.total_steps or self._data_ended()
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix(fvu=f"{metrics['fvu']:.3f}", l0=f"{metrics['l0']:.1f}")
                    if self.step in ckpt_steps or last:
                        metrics.update(self.evaluate_held_out())
                    if self.step % c.log_every == 0 or last:
                        self.history.append(metrics)
                        if main:
                            with open(self.out_dir / "metrics.jsonl", "a") as log:
                                log.write(json.dumps(metrics) + "\n")
                            if sinks is not None:
                                sinks.log(metrics, self.step)
                    if self.step in ckpt_steps:
                        self.save(metrics)
                    if last:
                        break
            if bar is not None:  # the fine-tune shows a bar of its own
                bar.close()
                bar = None
            metrics.update(self.train_thresholds(sinks))
        finally:
            if bar is not None:
                bar.close()
            if sinks is not None:
                sinks.close()
        self.save(metrics)
        if c.plots:  # on every rank: the firing counts' gather is a collective
            counts = self.sae.gather_latents(self.fire_count).cpu()
            if main:
                from .plots import plot_training

                plot_training(
                    self.history, counts, self.tokens_seen, self.out_dir, self.val_frequency
                )
        tensors = self.sae.full_state()
        if main:  # last: a run directory holding sae.safetensors holds the finished run
            save_sae(
                self.out_dir / "sae.safetensors",
                tensors,
                {"config": c.to_dict(), **self.sae_metadata(metrics)},
            )
        barrier()
        return metrics


def _progress(total: int, initial: int, *, enabled: bool, desc: str = "SAE"):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True)


def _endless(loader):
    """The loader's batches, epoch after epoch."""
    while True:
        yield from loader


def run(*configs: SAEConfig) -> int:
    """This process's share of one or more training runs, one after another on one mesh
    (torchrun's environment gives the world): per run the trainer, a resume, ``fit``, and
    rank 0's summary line. A mistake in a config or its paths is one line on stderr (rank
    0) and exit code 2, found before the first run starts where it can be
    (``check_runs``)."""
    try:
        if not configs:
            raise InvalidArgumentError("no config to train")
        if len(configs) > 1:
            check_runs(configs)
        mesh = make_mesh(configs[0].data_parallel_size, configs[0].model_parallel_size)
    except USER_ERRORS as e:  # a mistake in the config or paths: one line, exit 2
        return _user_error(e)
    for config in configs:
        try:
            trainer = Trainer(config, mesh)
            if config.resume:
                found = (
                    latest_checkpoint(config.out_dir)
                    if config.resume == "auto"
                    else Path(config.resume)
                )
                if found is None:
                    raise CheckpointError(f"resume=auto but {config.out_dir} has no checkpoint")
                trainer.load(found)
        except USER_ERRORS as e:
            return _user_error(e)
        metrics = trainer.fit()
        if is_main_process():
            parts = [k for k in metrics if k.startswith("val_fvu_")]  # prefixes, hook points
            print(json.dumps({k: metrics[k] for k in (*SUMMARY_KEYS, *parts) if k in metrics}))
        del trainer
    if torch.distributed.is_initialized():
        barrier()  # no rank tears gloo down while another still talks
        torch.distributed.destroy_process_group()
    return 0


def check_runs(configs: Sequence[SAEConfig]) -> None:
    """What runs trained together need before the first starts: one mesh, an out_dir
    each, every out_dir free (or resumable) and every dataset readable. What needs the
    data's width or the mesh is checked as each run starts; the runs before a failing
    one are finished and kept."""
    meshes = {(c.data_parallel_size, c.model_parallel_size) for c in configs}
    if len(meshes) > 1:
        raise InvalidArgumentError(
            "runs launched together share one mesh; their data_parallel_size x "
            f"model_parallel_size differ: {sorted(meshes)}"
        )
    out_dirs = [os.path.realpath(c.out_dir) for c in configs]
    if len(set(out_dirs)) != len(out_dirs):
        raise InvalidArgumentError(
            f"runs launched together need an out_dir each (an override applies to every "
            f"--config); given {out_dirs}"
        )
    for config in configs:
        check_run_dir(config)
        if not config.follow:  # a followed dataset may not hold a row yet
            open_training_source(config)


def _user_error(e: Exception) -> int:
    if os.environ.get("PYSPARK_SAFETENSORS_DEBUG"):
        raise e
    if os.environ.get("RANK", "0") == "0":  # every rank meets the same mistake
        print(f"error: {e}", file=sys.stderr)
    return 2


def launch(configs: SAEConfig | Sequence[SAEConfig], nproc_per_node: int = 1) -> int:
    """Train with ``configs`` (one, or several trained one after another by the same
    processes: a launch's start-up, torch's imports and the process group, is paid once)
    on ``nproc_per_node`` processes: in this process for one, else through torchrun, each
    config serialised once to a JSON file every worker loads (``--config``). With several
    processes and a 1 x 1 mesh in a config, the processes are data-parallel. Mistakes are
    caught here before torchrun starts. Returns the exit code."""
    if nproc_per_node < 1:
        raise InvalidArgumentError(f"nproc_per_node must be >= 1, got {nproc_per_node}")
    configs = [configs] if isinstance(configs, SAEConfig) else list(configs)
    if not configs:
        raise InvalidArgumentError("launch needs at least one config")
    if nproc_per_node > 1:
        configs = [
            dataclasses.replace(c, data_parallel_size=nproc_per_node)
            if c.data_parallel_size * c.model_parallel_size == 1
            else c
            for c in configs
        ]
    if nproc_per_node == 1:
        return run(*configs)
    try:
        check_runs(configs)  # one mesh for all: the first config's is every one's
        dp, mp = configs[0].data_parallel_size, configs[0].model_parallel_size
        if dp * mp != nproc_per_node:
            raise InvalidArgumentError(
                f"data_parallel_size {dp} x model_parallel_size {mp} = {dp * mp}, but "
                f"{nproc_per_node} processes are launched"
            )
    except USER_ERRORS as e:
        return _user_error(e)
    with tempfile.TemporaryDirectory(prefix="sae-config-") as tmp:
        files = [str(c.save(Path(tmp) / f"config-{i}.json")) for i, c in enumerate(configs)]
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc_per_node}", "-m", "pyspark_safetensors.sae.train",
            *(arg for file in files for arg in ("--config", file)),
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        return subprocess.run(cmd, env=env).returncode


def main(argv: list[str] | None = None) -> int:
    """``python -m pyspark_safetensors.sae.train [--config FILE ...] [key=value ...]``:
    one rank of a run (torchrun starts one per process); several ``--config`` files are
    trained one after another, the overrides applied to each."""
    parser = argparse.ArgumentParser(
        prog="python -m pyspark_safetensors.sae.train",
        description="Train an SAE on an activation dataset (launch with torchrun for DP x TP).",
    )
    parser.add_argument(
        "--config",
        action="append",
        help="TOML config (e.g. conf/sae.toml) or a saved JSON one; repeat it to train "
        "several runs one after another in the same processes",
    )
    parser.add_argument("overrides", nargs="*", help="key=value overrides of config fields")
    args = parser.parse_args(argv)
    try:
        configs = [SAEConfig.load(path, args.overrides) for path in args.config or [None]]
    except USER_ERRORS as e:
        return _user_error(e)
    return run(*configs)


if __name__ == "__main__":
    exit_worker(main())
