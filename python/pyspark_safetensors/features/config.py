"""``FeaturesConfig``: what the feature job reads, what it keeps per latent, where it writes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..errors import PysparkSafetensorsError


class FeaturesError(PysparkSafetensorsError, ValueError):
    """Input the feature job cannot use; the message names it and says what to change."""


@dataclass(frozen=True)
class FeaturesConfig:
    extraction: str = ""
    """An extraction (``extraction.json``, ``activations/``, ``samples.parquet``,
    ``texts.jsonl``; an image extraction's ``images.parquet``): a local directory or a
    URI (``s3://bucket/acts``, ...)."""
    sae: str = ""
    """An SAE file or directory: ours, SAELens' or sparsify's (``sae.ecosystem.read_sae``);
    TopK, BatchTopK or JumpReLU, each encoding by its own rule."""
    out: str = ""
    """Output directory or URI: ``latents.parquet``, ``contexts.parquet``, the browser
    (``index.html`` + ``data/``) and ``features.json`` (last), published whole."""
    hook: str = ""
    """The hook point whose activations the SAE encodes; empty = the SAE's recorded
    ``hook_point``, or the extraction's only hook point."""
    clt_layer: int = -1
    """A cross-layer transcoder's layer whose latents are studied (its position in the
    CLT's ``hook_points``, 0..L-1): that layer's MLP-input dataset (its recorded hook
    point, unless ``hook`` is set) encoded by its layer-l encoder under its top-k rule
    (``CrossLayerTranscoder.encode_layer``); -1 for any other SAE."""
    datasets: tuple[str, ...] = ()
    """A crosscoder's activation datasets, one per hook point in its block order (paths or
    URIs, row-aligned: the extraction's tokens, whose texts the examples show); empty =
    its recorded hook points' datasets in the extraction, else the datasets it was
    trained on (its checkpoint's config)."""
    top_n: int = 20
    """Top-activating tokens kept per latent."""
    context: int = 8
    """Tokens shown either side of each example token (text; an image example shows
    its whole image)."""
    samples_per_band: int = 3
    """Random examples per quantile band of each latent's non-zero activations."""
    bands: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75)
    """Quantile band edges of the random examples (here: bottom, second and third quarter)."""
    hist_bins: int = 40
    """Log-spaced histogram bins of non-zero activations between ``hist_min`` and
    ``hist_max`` (values outside fall in the end bins)."""
    hist_min: float = 1e-3
    hist_max: float = 1e3
    dense_frequency: float = 0.1
    """A latent firing on more than this fraction of tokens is marked dense."""
    batch_tokens: int = 4096
    """Tokens encoded at once inside a task (memory per task grows with it, not with the data)."""
    seed: int = 0
    """Seed of the random examples (a hash of token and latent: partitioning does not change them)."""
    threads: int = 0
    """Torch threads per task; 0 = torch's default (all cores: set it to cores / tasks
    when several tasks share a machine)."""
    device: str = ""
    """Torch device of the encoding; empty = cuda when available, else cpu."""
    overwrite: bool = False
    """Replace an existing output directory."""
    token_kinds: tuple[str, ...] = ()
    """An image extraction's tokens to study: "cls", "register", "patch" (empty: all). An
    SAE trained on the patches is studied on the patches (``("patch",)``), one trained on
    the CLS token on it; the examples' heat maps still show every patch."""
    factors: str = ""
    """An image extraction's ground truth: a parquet table of factor labels, one row per
    patch (``patch_row``, ``patch_col``, one string column per generative factor holding
    the value of the shape the patch lies in, null outside) or per image (``patch_mask``,
    a bool per patch, and the factors: the toy ViT's ``labels.parquet``), images named by
    ``image_id``, ``key`` or ``path``; the job adds ``ground_truth.parquet``: each factor
    value's best latent by patch AUROC."""

    def __post_init__(self):
        if self.top_n <= 0:
            raise FeaturesError(f"top_n must be >= 1, got {self.top_n}")
        if self.context < 0 or self.samples_per_band < 0:
            raise FeaturesError("context and samples_per_band must be >= 0")
        if self.hist_bins < 1 or not 0 < self.hist_min < self.hist_max:
            raise FeaturesError("hist_bins must be >= 1 and 0 < hist_min < hist_max")
        if list(self.bands) != sorted(self.bands) or not all(0 <= b <= 1 for b in self.bands):
            raise FeaturesError(f"bands must be increasing quantiles in [0, 1], got {self.bands}")
        unknown = set(self.token_kinds) - {"cls", "register", "patch"}
        if unknown:
            raise FeaturesError(
                f"token_kinds: {sorted(unknown)}; choose among cls, register, patch"
            )
        if self.clt_layer < -1:
            raise FeaturesError(f"clt_layer must be >= 0 (or -1: not a CLT), got {self.clt_layer}")
        if self.batch_tokens < 1:
            raise FeaturesError(f"batch_tokens must be >= 1, got {self.batch_tokens}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
