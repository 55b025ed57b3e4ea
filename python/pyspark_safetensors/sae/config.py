"""The trainer's configuration: a frozen dataclass read from TOML (``conf/sae.toml``) with
``key=value`` command-line overrides, saved next to every checkpoint."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ..format.errors import InvalidArgumentError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


#: Adam's learning rate at 16384 latents. Gao et al.'s 2e-4 was fitted to runs of billions
#: of tokens; on MiniLM activations (10^5 to 10^6 tokens, 768 to 12288 latents, batch
#: 4096) it left the held-out FVU 3 to 8x worse. Higher bases lower the FVU up to ~5e-3
#: but leave more latents that never fire; 2.8e-3 is where, at 3072 latents, both the
#: FVU and the dead latents beat sparsify's defaults (``docs/sae.md``).
LR_BASE = 2.8e-3
#: Steps up to which ``LR_BASE`` is the default; past them the default falls as 1 / steps
#: (the total steps times the rate held), down to ``LR_LONG``. On SynthSAEBench's model
#: (1,024 latents, 4,096 steps of 1,024 rows) the base rate left TopK at MCC 0.96,
#: BatchTopK 0.84 and JumpReLU 0.74 (317 latents dead), an eighth of it 0.99, 0.95 and
#: 0.98 (``docs/sae.md``); at 512 steps the base rate is the better one.
LR_BASE_STEPS = 512
#: Gao et al.'s and sparsify's rate at 16384 latents, fitted to runs of billions of
#: tokens: the default's floor however long the run.
LR_LONG = 2e-4

#: A latent is dead (AuxK trains it) once it has not fired for this many times the
#: interval at which the average latent fires (n / k tokens), or for a tenth of the run
#: if that is shorter. On SynthSAEBench's model (1,024 latents, k 12, 4,096 steps of
#: 1,024 rows) a tenth of the run alone (4,915 intervals) left 9 to 52 latents that never
#: fired on the evaluation set (JumpReLU, BatchTopK, Matryoshka), 1,024 intervals 0 to 3.
#: Shorter windows recovered more there, but raised the FVU of short runs on MiniLM
#: (12,288 latents: 0.016 at 124 intervals, 0.018 at 43) and the dead JumpReLU latents of
#: the shipped sweep (``docs/sae.md``).
DEAD_INTERVALS = 1024

#: Adam's betas. A latent's gradient is non-zero only on the tokens that select it, and
#: which latents those are keeps changing; a 1000-step second-moment memory (0.999)
#: outlasts short runs and keeps the scales of the first steps. A 50-step memory and
#: lighter momentum lowered the held-out FVU by 13 % and the dead latents from 1.8 % to
#: 0.8 % at 3072 latents (``docs/sae.md``); sparsify's Signum goes further still (no
#: second moment at all).
ADAM_BETAS = (0.8, 0.98)


#: The SAE architectures (``sae/architectures/``, registered under these names).
Architecture = Literal[
    "topk", "batchtopk", "jumprelu", "matryoshka", "transcoder", "skip_transcoder", "crosscoder",
    "clt",
]  # fmt: skip

#: The architectures trained on pairs (x from ``dataset``, y from ``target_dataset``).
TRANSCODERS = ("transcoder", "skip_transcoder")


def default_prefixes(n_latents: int, k: int) -> tuple[int, ...]:
    """Matryoshka's default nested prefixes: n/16, n/8, n/4, n/2, n (none below k)."""
    return tuple(sorted({max(k, n_latents // 2**i) for i in range(5)}))


@dataclass(frozen=True)
class SAEConfig:
    # data
    dataset: str = ""
    """Batch-mode activation dataset directory (token level, ``[B, d]`` rows)."""
    column: str = "activation"
    """Column of the dataset holding the activations."""
    val_dataset: str = ""
    """Held-out activations (a dataset of other texts; ``split_by_sample`` makes one):
    FVU, L0, dead and dense latents on it at every checkpoint and at the end, in
    ``metrics.jsonl`` (``val_*`` keys), the plots and the SAE's metadata. "" = none."""
    val_tokens: int = 65536
    """Held-out rows evaluated (the first ones); 0 = all."""
    target_dataset: str = ""
    """Transcoders: the dataset of what the decoder reconstructs (e.g. the MLP's output
    hook point), row-aligned with ``dataset`` (the same extraction's rows, in order)."""
    target_column: str = "activation"
    """Column of ``target_dataset`` holding the targets."""
    val_target_dataset: str = ""
    """Transcoders: the held-out targets, row-aligned with ``val_dataset``."""
    datasets: tuple[str, ...] = ()
    """Crosscoders: the row-aligned datasets of the hook points read and reconstructed
    together (each of the same width; ``dataset`` stays empty). Cross-layer transcoders:
    each layer's MLP input, in layer order."""
    val_datasets: tuple[str, ...] = ()
    """Crosscoders: the held-out datasets, one per entry of ``datasets``, in its order."""
    target_datasets: tuple[str, ...] = ()
    """Cross-layer transcoders: each layer's MLP output, in the order of ``datasets``
    (row-aligned with them)."""
    val_target_datasets: tuple[str, ...] = ()
    """Cross-layer transcoders: the held-out MLP outputs, one per ``val_datasets`` entry."""
    clt_tied_decoders: bool = False
    """Cross-layer transcoders: one decoder per source layer, shared by every target layer
    at or above it (instead of one per (source, target) pair)."""
    clt_activation: Literal["topk", "batchtopk"] = "topk"
    """Cross-layer transcoders: k latents per layer per row ("topk"), or k x batch per
    layer per batch in training ("batchtopk")."""
    clt_loss: Literal["pooled", "per_layer"] = "pooled"
    """Cross-layer transcoders: the reconstruction loss. "pooled": the FVU of every target
    layer together (the layers' squared errors summed, over the sum of their variances),
    so each layer weighs by its output's variance, as its error weighs in the residual
    stream that the replacement model adds the outputs to; "per_layer": the sum of the
    layers' FVUs, each layer alike (sparsify's cross_layer loss), which on a toy Llama
    whose first MLP writes 24x the variance of the others let the first layer's latents
    serve the small layers and lost CE to per-layer transcoders (``docs/sae.md``)."""
    clt_thresholds: Literal["trained", "calibrated"] = "trained"
    """Cross-layer transcoders: how the file's JumpReLU thresholds (what circuit-tracer runs
    from an export, and ``rule="threshold"``) are set once the top-k training ends.
    "calibrated": fitted to the top-k code's rows (``calibrate_thresholds``: frequency
    matching, then the least-error cut); "trained": from the frequency-matched ones, a
    straight-through fine-tune of the thresholds and the dictionary under the threshold
    code, its L0 held at k per layer (``architectures/clt.py``, trained thresholds;
    metadata ``threshold_source``). Per-layer transcoders keep no thresholds (a top-k
    code only, exported as such), so they have no such step."""
    clt_threshold_fraction: float = 0.5
    """Cross-layer transcoders, trained thresholds: the fine-tune's tokens, as a fraction
    of the training tokens (batches of ``batch_size``, at least one; more than 1 is more
    than a pass). A step costs about 2.5 top-k steps (a CPU, 4 x 1,024 latents)."""
    clt_threshold_lr: float = 0.05
    """Cross-layer transcoders, trained thresholds: Adam's learning rate of the log
    thresholds (a step moves a threshold by about this fraction of itself)."""
    clt_threshold_dictionary_lr: float = 0.25
    """Cross-layer transcoders, trained thresholds: the dictionary's learning rate in the
    fine-tune, as a fraction of ``learning_rate`` (0: the thresholds alone)."""
    clt_threshold_bandwidth: float = 0.1
    """Cross-layer transcoders, trained thresholds: the width of the rectangle kernel of
    the thresholds' pseudo-derivative, as a fraction of each layer's median threshold."""
    hook_point: str = ""
    """Recorded in the checkpoint; taken from the dataset's ``hook_point`` metadata if empty."""
    # model
    d: int = 0
    """Input width; 0 = the dataset's sample width (a non-zero value must match it); a
    crosscoder's is the hook points' widths summed; a cross-layer transcoder's is one
    layer's."""
    d_out: int = 0
    """Reconstruction width; 0 = the target dataset's width (``d`` for an SAE; a
    cross-layer transcoder's: one layer's)."""
    expansion_factor: int = 16
    n_latents: int = 0
    """Dictionary size (a cross-layer transcoder's: per layer); 0 = ``expansion_factor * d``."""
    k: int = 32
    """Active latents per token (a cross-layer transcoder's: per layer)."""
    architecture: Architecture = "topk"
    """"topk": k latents per row; "batchtopk": k x batch latents per batch in training
    and a learned threshold at inference; "jumprelu": a learned threshold per latent,
    trained towards an average of k active latents; "matryoshka": BatchTopK whose nested
    prefixes (``matryoshka_prefixes``) each learn to reconstruct; "transcoder" and
    "skip_transcoder": TopK from ``dataset`` to ``target_dataset`` (the skip variant with
    a dense linear path); "crosscoder": TopK over the concatenated ``datasets``, one
    decoder block per hook point; "clt": a cross-layer transcoder, a code per layer
    read from ``datasets`` that reconstructs every ``target_datasets`` entry at or
    above its layer (``docs/sae.md`` says how each maps onto the LUT's per-row top-k)."""
    matryoshka_prefixes: tuple[int, ...] = ()
    """Matryoshka: the nested prefixes' latent counts, ascending, the last the whole
    dictionary; empty = n/16, n/8, n/4, n/2, n."""
    l0_coef: float = 1.0
    """JumpReLU: weight of the penalty ``(L0 / k - 1)^2`` that pulls the mean L0 to k (a
    cross-layer transcoder's trained thresholds: per layer, summed)."""
    jumprelu_bandwidth: float = 0.05
    """JumpReLU: width of the rectangle kernel of the threshold's straight-through
    gradient, in units of the pre-activations."""
    jumprelu_init_threshold: float = 0.05
    """JumpReLU: every latent's threshold at the start."""
    jumprelu_threshold_lr: float = 0.0
    """JumpReLU: the thresholds' learning rate (the same schedule); 0 = ``lr``, or when
    that is 0 the short-run default LR_BASE / sqrt(n_latents / 16384) whatever the run's
    length: the thresholds climb to the target L0 at the same pace in a long run, where
    the dictionary's rate is lower."""
    k_start: int = 0
    """k at step 0, annealed linearly to ``k`` over ``k_anneal_fraction`` of training; 0 = no annealing."""
    k_anneal_fraction: float = 0.1
    k_aux: int = 0
    """Latents of the AuxK loss; 0 = d // 2."""
    aux_coef: float = 1 / 32
    aux_rows: int = 512
    """Rows of each global batch the AuxK loss reads (the first: batches are shuffled);
    0 = all. Its top-k picks k_aux latents per row against the code's k, so on every row
    of a batch of 4,096 it added 0.7 s to a 0.85 s CPU step (d = 768, 16,384 latents)."""
    dead_tokens: int = 0
    """A latent that has not fired for this many tokens is dead (and AuxK trains it);
    0 = a tenth of the training tokens (so that short runs see their dead latents too), at
    most DEAD_INTERVALS times n_latents / k (the average latent's interval between
    firings) and 10M (the window of Gao et al.), at least one batch."""
    init_from: str = ""
    """An SAE to fine-tune instead of a fresh one: our file, run or checkpoint directory,
    or a SAELens / sparsify directory (its shape must match ``d`` and ``n_latents``)."""
    b_dec_init: Literal["geometric_median", "mean", "zeros"] = "geometric_median"
    init_samples: int = 16384
    """Activations used to initialise ``decoder_bias``."""
    # optimisation
    lr: float = 0.0
    """Adam learning rate; 0 = LR_BASE / sqrt(n_latents / 16384): the dictionary-size
    scaling of Gao et al. and sparsify, with the base measured on real activations
    (``docs/sae.md``), for runs of up to LR_BASE_STEPS steps; a longer run's falls as
    1 / steps, to no less than LR_LONG / sqrt(n_latents / 16384) (``learning_rate_at``);
    a transcoder's too (``sae/architectures/transcoder.py`` says why it needs no rate of
    its own)."""
    adam_betas: tuple[float, float] = ADAM_BETAS
    adam_eps: float = 6.25e-10
    warmup_fraction: float = 0.05
    """The learning rate warms up linearly over this first fraction of the steps."""
    warmup_steps: int = 0
    """Warm-up length in steps; > 0 overrides ``warmup_fraction``."""
    decay_fraction: float = 0.2
    """The learning rate decays linearly to 0 over this last fraction of the steps."""
    grad_clip: float = 1.0
    """Global gradient-norm clip; 0 = off."""
    batch_size: int = 4096
    """Global batch (tokens per step), split evenly over the data-parallel ranks."""
    tokens: int = 0
    """Training tokens; 0 = one pass over the dataset."""
    follow: bool = False
    """Train on datasets still being written (an extraction or a stream appending to
    them): wait until each holds a global batch, take the rows of each commit as it lands
    (``torch.FollowingBatches``), and stop at ``tokens`` (required: the schedule is
    planned on it) or once every dataset is marked complete and read (the run then ends
    there, before its schedule's decay). ``num_workers`` is not used."""
    follow_poll_s: float = 1.0
    """Following: seconds between reads of the manifests while waiting for rows."""
    follow_timeout_s: float = 600.0
    """Following: fail after waiting this long with no new row committed; 0 = wait for ever."""
    seed: int = 0
    autocast: bool = True
    """bf16 autocast on CUDA (parameters and optimizer stay float32); ignored on CPU."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    num_workers: int = 0
    # parallelism
    data_parallel_size: int = 1
    model_parallel_size: int = 1
    # outputs
    out_dir: str = "runs/sae"
    log_every: int = 50
    checkpoints: int = 6
    """Log-spaced intermediate checkpoints (the final one is always written)."""
    progress: bool = True
    plots: bool = True
    """Write ``training.png`` and ``latent_frequency.png`` at the end (rank 0). Off for
    runs that need only the SAE and its metrics (sweeps, tests): the plots take more CPU
    than a small run's training."""
    log_to: tuple[str, ...] = ()
    """Extra metric sinks beside metrics.jsonl: "tensorboard" (out_dir/tensorboard) and/or
    "wandb"; each needs its package installed."""
    overwrite: bool = False
    """Start over in an ``out_dir`` that already holds a run (its log, checkpoints and SAE
    are replaced); without it such a directory is refused unless resuming."""
    saev_patches: Literal["cls", "image", "all"] = "image"
    """When ``dataset`` is a saev dump: the tokens to train on (docs/interop.md)."""
    saev_layer: str = "all"
    """When ``dataset`` is a saev dump: one recorded ViT layer, or "all"."""
    resume: str = ""
    """Checkpoint directory to continue from; "auto" = the newest one in ``out_dir``."""

    def __post_init__(self):
        positive = ["expansion_factor", "k", "batch_size", "log_every", "init_samples"]
        for name in positive:
            if getattr(self, name) < 1:
                raise InvalidArgumentError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ["d", "n_latents", "k_start", "k_aux", "aux_rows", "tokens", "checkpoints",
                     "num_workers", "val_tokens"]:  # fmt: skip
            if getattr(self, name) < 0:
                raise InvalidArgumentError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.data_parallel_size < 1 or self.model_parallel_size < 1:
            raise InvalidArgumentError("data_parallel_size and model_parallel_size must be >= 1")
        if self.batch_size % self.data_parallel_size:
            raise InvalidArgumentError(
                f"batch_size {self.batch_size} does not split over {self.data_parallel_size} data-parallel ranks"
            )
        if (self.lr < 0 or self.grad_clip < 0 or self.aux_coef < 0 or self.l0_coef < 0
                or self.jumprelu_threshold_lr < 0):  # fmt: skip
            raise InvalidArgumentError(
                "lr, grad_clip, aux_coef, l0_coef and jumprelu_threshold_lr must be >= 0"
            )
        if self.jumprelu_bandwidth <= 0 or self.jumprelu_init_threshold <= 0:
            raise InvalidArgumentError("jumprelu_bandwidth and jumprelu_init_threshold must be > 0")
        for name in ("decay_fraction", "k_anneal_fraction", "warmup_fraction"):
            if not 0 <= getattr(self, name) <= 1:
                raise InvalidArgumentError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.warmup_steps < 0 or self.dead_tokens < 0:
            raise InvalidArgumentError("warmup_steps and dead_tokens must be >= 0")
        for name, choices in [
            ("b_dec_init", ("geometric_median", "mean", "zeros")),
            ("device", ("auto", "cpu", "cuda")),
            ("architecture", typing.get_args(Architecture)),
            ("clt_activation", ("topk", "batchtopk")),
            ("clt_loss", ("pooled", "per_layer")),
        ]:
            if getattr(self, name) not in choices:
                raise InvalidArgumentError(
                    f"{name} must be one of {choices}, got {getattr(self, name)!r}"
                )
        if self.d_out < 0:
            raise InvalidArgumentError(f"d_out must be >= 0, got {self.d_out}")
        if self.clt_thresholds not in ("trained", "calibrated"):
            raise InvalidArgumentError(
                f"clt_thresholds must be 'trained' or 'calibrated', got {self.clt_thresholds!r}"
            )
        if (self.clt_threshold_fraction <= 0 or self.clt_threshold_lr <= 0
                or self.clt_threshold_dictionary_lr < 0 or self.clt_threshold_bandwidth <= 0):  # fmt: skip
            raise InvalidArgumentError(
                "clt_threshold_fraction, clt_threshold_lr and clt_threshold_bandwidth must be "
                "> 0, clt_threshold_dictionary_lr >= 0"
            )
        if self.follow and not self.tokens:
            raise InvalidArgumentError("follow needs tokens: the budget the schedule is planned on")
        if self.follow_poll_s <= 0 or self.follow_timeout_s < 0:
            raise InvalidArgumentError("follow_poll_s must be > 0 and follow_timeout_s >= 0")
        self._check_data()
        n = self.n_latents or self.expansion_factor * self.d
        if self.d and self.matryoshka_prefixes:
            _ = self.prefixes  # refuses ill-formed prefixes once the size is known
        if self.d and self.k > n:
            raise InvalidArgumentError(f"k {self.k} exceeds n_latents {n}")
        if self.d and n % self.model_parallel_size:
            raise InvalidArgumentError(
                f"n_latents {n} is not divisible by model_parallel_size {self.model_parallel_size}"
            )

    def _check_data(self) -> None:
        """Each family names the data it needs, and only that."""
        transcoder = self.architecture in TRANSCODERS
        if transcoder and self.dataset and not self.target_dataset:
            raise InvalidArgumentError(
                f"a {self.architecture} reconstructs another hook point: give target_dataset "
                "(row-aligned with dataset, e.g. the MLP's output beside its input)"
            )
        if not transcoder and (self.target_dataset or self.val_target_dataset):
            raise InvalidArgumentError(
                f"target_dataset is for transcoders; a {self.architecture} reconstructs its "
                "input (architecture = 'transcoder' or 'skip_transcoder' to use it)"
            )
        if self.val_dataset and transcoder and not self.val_target_dataset:
            raise InvalidArgumentError(
                "val_dataset of a transcoder needs val_target_dataset (its held-out targets)"
            )
        if self.architecture == "clt":
            self._check_clt_data()
        elif any((self.target_datasets, self.val_target_datasets, self.clt_tied_decoders,
                  self.clt_activation != "topk", self.clt_loss != "pooled",
                  self._clt_threshold_options() != CLT_THRESHOLD_DEFAULTS)):  # fmt: skip
            raise InvalidArgumentError(
                "target_datasets, val_target_datasets, clt_tied_decoders, clt_activation, "
                "clt_loss and the clt_threshold* options are for architecture = 'clt' (a "
                "cross-layer transcoder)"
            )
        crosscoder = self.architecture == "crosscoder"
        if crosscoder:
            if self.dataset:
                raise InvalidArgumentError(
                    "a crosscoder reads datasets = [...] (one per hook point), not dataset"
                )
            if self.datasets and len(self.datasets) < 2:
                raise InvalidArgumentError(
                    f"a crosscoder reads at least 2 hook points' datasets, got {list(self.datasets)}"
                )
            if self.val_datasets and len(self.val_datasets) != len(self.datasets):
                raise InvalidArgumentError(
                    f"val_datasets has {len(self.val_datasets)} entries, datasets "
                    f"{len(self.datasets)}: give one held-out dataset per hook point"
                )
            if self.val_dataset:
                raise InvalidArgumentError("a crosscoder's held-out data is val_datasets")
        elif (self.datasets or self.val_datasets) and self.architecture != "clt":
            raise InvalidArgumentError(
                "datasets = [...] is for crosscoders; give dataset (architecture = "
                "'crosscoder' to read several hook points)"
            )
        if self.matryoshka_prefixes and self.architecture != "matryoshka":
            raise InvalidArgumentError("matryoshka_prefixes is for architecture = 'matryoshka'")

    def _clt_threshold_options(self) -> dict:
        return {name: getattr(self, name) for name in CLT_THRESHOLD_DEFAULTS}

    def _check_clt_data(self) -> None:
        """A cross-layer transcoder reads one input and one target dataset per layer."""
        if self.dataset or self.target_dataset or self.val_dataset or self.val_target_dataset:
            raise InvalidArgumentError(
                "a cross-layer transcoder reads datasets = [MLP input per layer] and "
                "target_datasets = [MLP output per layer] (val_datasets / "
                "val_target_datasets held out), not dataset / target_dataset"
            )
        if len(self.target_datasets) != len(self.datasets):
            raise InvalidArgumentError(
                f"a cross-layer transcoder needs one target dataset per layer: datasets has "
                f"{len(self.datasets)} entries, target_datasets {len(self.target_datasets)}"
            )
        if len(self.val_target_datasets) != len(self.val_datasets):
            raise InvalidArgumentError(
                f"val_datasets has {len(self.val_datasets)} entries, val_target_datasets "
                f"{len(self.val_target_datasets)}: give the held-out output of every layer"
            )
        if self.val_datasets and len(self.val_datasets) != len(self.datasets):
            raise InvalidArgumentError(
                f"val_datasets has {len(self.val_datasets)} entries, datasets "
                f"{len(self.datasets)}: give one held-out dataset per layer"
            )

    @property
    def training_datasets(self) -> tuple[str, ...]:
        """Every dataset the run trains on (checked before a launch)."""
        return tuple(
            p for p in (self.dataset, self.target_dataset, *self.datasets, *self.target_datasets)
            if p
        )  # fmt: skip

    # derived values (valid once ``d`` is known)

    @property
    def prefixes(self) -> tuple[int, ...]:
        """Matryoshka's nested prefix sizes: ``matryoshka_prefixes`` checked, or the
        default halvings n/16 .. n (those that are >= k)."""
        n = self.latents
        if not self.matryoshka_prefixes:
            return default_prefixes(n, self.k)
        sizes = tuple(int(m) for m in self.matryoshka_prefixes)
        if list(sizes) != sorted(set(sizes)) or sizes[-1] != n or sizes[0] < 1:
            raise InvalidArgumentError(
                f"matryoshka_prefixes must ascend strictly and end at n_latents ({n}), "
                f"got {list(sizes)}"
            )
        return sizes

    @property
    def latents(self) -> int:
        return self.n_latents or self.expansion_factor * self.d

    @property
    def learning_rate(self) -> float:
        """``lr``, or the default of a run of up to LR_BASE_STEPS steps."""
        return self.lr or LR_BASE / (self.latents / 16384) ** 0.5

    def learning_rate_at(self, steps: int) -> float:
        """The rate of a run of ``steps`` steps: ``lr``, or the default (``lr``'s
        docstring)."""
        if self.lr:
            return self.lr
        width = (self.latents / 16384) ** 0.5
        return max(LR_LONG, LR_BASE * min(1.0, LR_BASE_STEPS / max(steps, 1))) / width

    @property
    def threshold_learning_rate(self) -> float:
        """A JumpReLU SAE's thresholds' rate (``jumprelu_threshold_lr``)."""
        return self.jumprelu_threshold_lr or self.learning_rate

    def dead_window(self, total_tokens: int) -> int:
        """Tokens without firing after which a latent counts as dead."""
        rare = DEAD_INTERVALS * self.latents // self.k  # the average latent fires every n / k
        return self.dead_tokens or max(self.batch_size,
                                       min(rare, total_tokens // 10, 10_000_000))  # fmt: skip

    @property
    def aux_k(self) -> int:
        return self.k_aux or max(1, (self.d_out or self.d) // 2)

    # serialisation

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def config_hash(self) -> str:
        """sha256 of the canonical JSON of the fields that define the SAE and its training
        (output and logging fields excluded)."""
        skip = {
            "out_dir",
            "log_every",
            "checkpoints",
            "progress",
            "plots",
            "num_workers",
            "device",
            "resume",
            "overwrite",
            "log_to",
            "val_dataset",
            "val_target_dataset",
            "val_datasets",
            "val_target_datasets",
            "val_tokens",
            "data_parallel_size",
            "model_parallel_size",
            "follow_poll_s",
            "follow_timeout_s",
        }
        body = {k: v for k, v in self.to_dict().items() if k not in skip}
        if self.architecture != "clt":  # the runs from before these fields keep their hash
            for name in ("target_datasets", "clt_tied_decoders", "clt_activation", "clt_loss",
                         *CLT_THRESHOLD_DEFAULTS):  # fmt: skip
                del body[name]
        elif self.clt_thresholds == "calibrated":  # what every CLT run did before the field
            for name in CLT_THRESHOLD_DEFAULTS:
                del body[name]
        if not self.follow:  # the runs from before the field keep their hash
            del body["follow"]
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()

    def save(self, path: str | Path) -> Path:
        """Write the config as JSON (what ``load`` reads back, e.g. in torchrun's workers)."""
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path | None = None, overrides: list[str] = ()) -> SAEConfig:
        """From a TOML file (top-level keys or an ``[sae]`` table) or a JSON file written by
        ``save`` (``.json``), and ``key=value`` overrides; unknown keys and ill-typed
        values are errors naming them."""
        values: dict = {}
        if path is not None and str(path).endswith(".json"):
            try:
                data = json.loads(Path(path).read_text())
            except json.JSONDecodeError as e:
                raise InvalidArgumentError(f"{path}: not JSON ({e})") from None
            values.update(data)
        elif path is not None:
            data = read_toml(path)
            values.update(data.get("sae", data))
        for item in overrides:
            key, sep, raw = item.partition("=")
            if not sep:
                raise InvalidArgumentError(f"override {item!r} is not key=value")
            values[key.strip().replace("-", "_")] = _parse(key.strip(), raw.strip())
        return cls.from_dict(values)

    @classmethod
    def from_dict(cls, values: dict) -> SAEConfig:
        if "activation" in values and "architecture" not in values:  # its earlier name
            values = {("architecture" if k == "activation" else k): v for k, v in values.items()}
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - set(fields))
        if unknown:
            raise InvalidArgumentError(f"unknown config key(s) {unknown}; known: {sorted(fields)}")
        hints = typing.get_type_hints(cls)
        return cls(**{k: _coerce(k, v, hints[k]) for k, v in values.items()})


#: A cross-layer transcoder's trained-threshold options and their defaults (the other
#: architectures leave them so).
CLT_THRESHOLD_DEFAULTS = {
    f.name: f.default for f in dataclasses.fields(SAEConfig) if f.name.startswith("clt_threshold")
}


def read_toml(path: str | Path) -> dict:
    """A TOML file's tables; a file that is not TOML is an ``InvalidArgumentError`` naming it."""
    with open(path, "rb") as f:
        try:
            return tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise InvalidArgumentError(f"{path}: not TOML ({e})") from None


def _parse(key: str, raw: str):
    """A command-line value: TOML syntax when it parses (numbers, booleans, arrays,
    quoted strings), else the bare string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _coerce(key: str, value, hint):
    origin = typing.get_origin(hint)
    if origin is Literal:
        return value
    if origin is tuple and typing.get_args(hint)[-1] is Ellipsis:  # tuple[str, ...]
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise InvalidArgumentError(f"{key} must be a list, got {value!r}")
        item = typing.get_args(hint)[0]
        if item is int and any(isinstance(v, bool) or not isinstance(v, int) for v in value):
            raise InvalidArgumentError(f"{key} must be a list of integers, got {value!r}")
        return tuple(item(v) for v in value)
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(typing.get_args(hint)):
            raise InvalidArgumentError(
                f"{key} must be a list of {len(typing.get_args(hint))} numbers"
            )
        return tuple(float(v) for v in value)
    if hint is bool:
        if not isinstance(value, bool):
            raise InvalidArgumentError(f"{key} must be true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidArgumentError(f"{key} must be an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidArgumentError(f"{key} must be a number, got {value!r}")
        return float(value)
    return str(value)
