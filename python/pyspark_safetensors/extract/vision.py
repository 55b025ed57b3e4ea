"""A vision transformer with hooks on chosen modules: images in, every token's activations
out (``[tokens, H]`` per image: CLS, registers, then the patches row-major, the model's
own scan order).

Any local Hugging Face vision encoder directory: ViT (``ViTModel``,
``ViTForImageClassification``, loaded with its head), CLIP's and SigLIP's vision towers
(``CLIPVisionModel``, ``SiglipVisionModel``, or the ``vision_model`` of a ``CLIPModel``/
``SiglipModel`` directory: hook points are named inside the tower either way), DINOv2
(``Dinov2Model``, ``Dinov2WithRegistersModel``). Images are decoded with PIL and resized
and normalised by the directory's own ``AutoImageProcessor``.

No Spark here: the extraction's tasks call ``VisionExtractor``, and so do the tests and
the benchmark's plain loop. torch and transformers are imported inside the functions.
"""

from __future__ import annotations

import io
import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from .model import ExtractionError, _collector_paused, capture_hooks, hook_points, stored

TOKEN_KINDS = ("cls", "register", "patch")
"""``token_kind`` codes of the token-level datasets: the index in this tuple (a dataset's
columns are tensors, so the kind is stored as its code; the names are in each dataset's
metadata and in ``extraction.json``)."""
DUAL_ENCODERS = ("clip", "siglip", "siglip2", "altclip", "chinese_clip")
"""Model types of image-text dual encoders: their ``vision_model`` is the one run."""
THUMBNAIL_PNG_LEVEL = 1
"""zlib level of the thumbnails: fast; they are small anyway."""
_LAYER = re.compile(r"(?:^|\.)(?:layer|layers|h|blocks|block)\.(\d+)(?:\.|$)")


def hook_layer(hook_name: str) -> int:
    """The transformer block index in a hook point's module name
    (``encoder.layer.3.output:output`` -> 3), -1 when it names none (embeddings, final
    norm)."""
    match = _LAYER.search(hook_name.rpartition(":")[0] or hook_name)
    return int(match.group(1)) if match else -1


@dataclass(frozen=True)
class ImageTokens:
    """The tokens of one image, in the model's order: ``n_cls`` CLS tokens (0 for SigLIP,
    which has none), ``n_registers`` register tokens (DINOv2 with registers), then
    ``grid[0] x grid[1]`` patches row-major."""

    n_cls: int
    n_registers: int
    grid: tuple[int, int]
    """Patch rows, patch columns."""
    patch_size: int
    image_size: tuple[int, int]
    """Height, width of the model input in pixels."""

    @property
    def n_prefix(self) -> int:
        return self.n_cls + self.n_registers

    @property
    def n_tokens(self) -> int:
        return self.n_prefix + self.grid[0] * self.grid[1]

    def kinds(self) -> np.ndarray:
        """``token_kind`` code (``TOKEN_KINDS``) of each position, int8."""
        return np.repeat(
            np.arange(3, dtype=np.int8),
            [self.n_cls, self.n_registers, self.n_tokens - self.n_prefix],
        )

    def patch_rows(self) -> np.ndarray:
        """Each position's patch row, -1 for CLS and registers (int32)."""
        return np.concatenate([np.full(self.n_prefix, -1, np.int32),
                               np.repeat(np.arange(self.grid[0], dtype=np.int32), self.grid[1])])  # fmt: skip

    def patch_cols(self) -> np.ndarray:
        """Each position's patch column, -1 for CLS and registers (int32)."""
        return np.concatenate([np.full(self.n_prefix, -1, np.int32),
                               np.tile(np.arange(self.grid[1], dtype=np.int32), self.grid[0])])  # fmt: skip

    def to_dict(self) -> dict:
        return {**asdict(self), "grid": list(self.grid), "image_size": list(self.image_size)}

    @classmethod
    def from_dict(cls, doc: dict) -> ImageTokens:
        return cls(doc["n_cls"], doc["n_registers"], tuple(doc["grid"]), doc["patch_size"],
                   tuple(doc["image_size"]))  # fmt: skip


def decode_image(data: bytes):
    """Encoded image bytes (PNG, JPEG, ...) as an RGB PIL image, fully decoded: a
    truncated or unreadable file raises here (PIL's error)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        image.load()
        return image.convert("RGB")


def check_image(data: bytes) -> tuple[int, int]:
    """(width, height) of encoded image bytes, after reading every byte of the image
    (a truncated file raises). JPEGs decode at 1/8 scale (``draft``): the whole stream is
    still read, at a fraction of the cost."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        size = image.size
        image.draft("RGB", (max(1, size[0] // 8), max(1, size[1] // 8)))
        image.load()
    return size


def png_of_pixels(pixels_hwc: np.ndarray) -> bytes:
    """PNG bytes of an RGB uint8 array [H, W, 3]."""
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(pixels_hwc).save(out, format="PNG", compress_level=THUMBNAIL_PNG_LEVEL)
    return out.getvalue()


def _config_of(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    if not path.is_file():
        raise ExtractionError(f"{model_dir}: not a Hugging Face model directory (no config.json)")
    return json.loads(path.read_text())


def is_image_classifier(model_dir: str | os.PathLike) -> bool:
    """Whether ``config.json`` names an image-classification class among its
    ``architectures`` (``ViTForImageClassification``, ...)."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES,
    )

    architectures = _config_of(Path(model_dir)).get("architectures") or []
    names = set()
    for value in MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES.values():
        names.update(value if isinstance(value, tuple) else (value,))
    return any(a in names for a in architectures)


def load_vision_model(model_dir: str | os.PathLike):
    """(image processor, model, tower) from a local directory, offline, in eval mode.
    ``model``: an image classifier with its head (``AutoModelForImageClassification``)
    or the ``AutoModel``; ``tower``: the module run and hooked (a dual encoder's
    ``vision_model``, else the model itself)."""
    model_dir = Path(model_dir)
    config = _config_of(model_dir)
    if not (model_dir / "preprocessor_config.json").is_file():
        raise ExtractionError(
            f"{model_dir}: no preprocessor_config.json (the image processor); an image "
            "extraction needs a vision model directory with its image processor"
        )
    with _collector_paused():
        from transformers import AutoImageProcessor, AutoModel, AutoModelForImageClassification
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()  # the PIL-backend notice, once per worker
        # the PIL backend everywhere: the same pixels whether or not torchvision is there
        processor = AutoImageProcessor.from_pretrained(
            model_dir, local_files_only=True, backend="pil"
        )
        auto = AutoModelForImageClassification if is_image_classifier(model_dir) else AutoModel
        model = auto.from_pretrained(model_dir, local_files_only=True).eval()
    dual = config.get("model_type") in DUAL_ENCODERS
    tower = model.vision_model if dual and hasattr(model, "vision_model") else model
    return processor, model, tower


def block_outputs(tower) -> list[str]:
    """``{blocks}.{i}:output`` for every transformer block of ``tower`` (the longest
    module list named ``layer``, ``layers``, ``blocks`` or ``h``): the residual stream
    after each block, an image extraction's hook points unless others are given."""
    import torch

    lists = [(len(m), name) for name, m in tower.named_modules()
             if isinstance(m, torch.nn.ModuleList) and name.rpartition(".")[2] in
             ("layer", "layers", "blocks", "h")]  # fmt: skip
    if not lists:
        raise ExtractionError("no transformer blocks found (a module list named layer, "
                              "layers, blocks or h): give the hook points")  # fmt: skip
    count, name = max(lists)
    return [f"{name}.{i}:output" for i in range(count)]


def _vision_config(model):
    config = model.config
    return getattr(config, "vision_config", None) or config


class VisionExtractor:
    """Runs a vision model on batches of images and captures the hooks' activations:
    every token of every image (``layout``: CLS, registers, patches). ``mlp_layers``: as
    ``Extractor``'s, inside the tower."""

    def __init__(
        self,
        model_dir: str | os.PathLike,
        hooks: list[str],
        *,
        batch_size: int = 32,
        dtype: str = "F16",
        threads: int = 0,
        mlp_layers: str = "",
    ):
        if dtype not in ("F16", "BF16", "F32"):
            raise ExtractionError(f"dtype must be F16, BF16 or F32, got {dtype!r}")
        self.processor, self.model, self.tower = load_vision_model(model_dir)
        import torch

        if threads:
            torch.set_num_threads(threads)
        from .config import DEFAULT_HOOKS

        if tuple(hooks) == DEFAULT_HOOKS:  # the text default: every block's output instead
            hooks = block_outputs(self.tower)
        self.hooks, self.mlp_blocks = hook_points(self.tower, hooks, mlp_layers)
        self.batch_size, self.dtype = batch_size, dtype
        self._captured = capture_hooks(self.tower, self.hooks)
        self._denormalise = self._pixel_inverse()
        self.layout = self._probe_layout()

    def _pixel_inverse(self):
        """(scale [3], offset [3]) with ``pixels = pixel_values * scale + offset`` (0-255):
        the processor's normalisation and rescaling undone, for the thumbnails."""
        p = self.processor
        mean = np.asarray(getattr(p, "image_mean", None) or [0.0] * 3, np.float32)
        std = np.asarray(getattr(p, "image_std", None) or [1.0] * 3, np.float32)
        if not getattr(p, "do_normalize", False):
            mean, std = np.zeros(3, np.float32), np.ones(3, np.float32)
        rescale = (
            float(getattr(p, "rescale_factor", 1 / 255)) if getattr(p, "do_rescale", True) else 1.0
        )
        return std / rescale, mean / rescale

    def _probe_layout(self) -> ImageTokens:
        """The token layout, from one forward pass on a blank image: the grid from the
        processed image's size and the patch size, the prefix from the tokens counted."""
        from PIL import Image

        pixel_values = self._pixel_values([Image.new("RGB", (64, 64))])
        height, width = pixel_values.shape[-2:]
        patch = _vision_config(self.model).patch_size
        patch = patch[0] if isinstance(patch, (list, tuple)) else int(patch)
        grid = (height // patch, width // patch)
        tokens = {name: a.shape for name, a in self._forward(pixel_values).items()}
        for name, shape in tokens.items():
            if len(shape) != 3:
                raise ExtractionError(
                    f"hook {name} gives a tensor of shape {list(shape)}, not [images, tokens, "
                    "width]: choose a module inside the transformer's blocks"
                )
        counts = {shape[1] for shape in tokens.values()}
        if len(counts) != 1:
            raise ExtractionError(f"hook points of different token counts: {tokens}")
        (n_tokens,) = counts
        n_registers = int(getattr(_vision_config(self.model), "num_register_tokens", 0) or 0)
        n_cls = n_tokens - grid[0] * grid[1] - n_registers
        if n_cls not in (0, 1):
            raise ExtractionError(
                f"{n_tokens} tokens per image: not {grid[0]}x{grid[1]} patches + {n_registers} "
                "registers + CLS; this model's token layout is not one the extraction knows"
            )
        return ImageTokens(n_cls, n_registers, grid, patch, (int(height), int(width)))

    def widths(self) -> dict[str, int]:
        """Hidden width of each hook point."""
        from PIL import Image

        acts = self._forward(self._pixel_values([Image.new("RGB", (64, 64))]))
        return {name: int(a.shape[-1]) for name, a in acts.items()}

    def _pixel_values(self, images: list):
        return self.processor(images=images, return_tensors="pt")["pixel_values"]

    def _forward(self, pixel_values) -> dict:
        import torch

        self._captured.clear()
        with torch.inference_mode():
            self.tower(pixel_values=pixel_values)
        return {h.name: self._captured[h.name] for h in self.hooks}

    def run(self, images: list, *, thumbnails: bool = False):
        """``(activations, thumbnails)``: for each image (PIL), hook name -> ``[tokens, H]``
        in the stored dtype; with ``thumbnails``, each image as the model sees it (after
        resizing and cropping, before normalisation) as PNG bytes, else None."""
        acts_out: list[dict[str, np.ndarray]] = []
        thumbs: list[bytes] | None = [] if thumbnails else None
        for start in range(0, len(images), self.batch_size):
            pixel_values = self._pixel_values(images[start : start + self.batch_size])
            captured = {n: a.float().numpy() for n, a in self._forward(pixel_values).items()}
            for j in range(pixel_values.shape[0]):
                acts_out.append({n: stored(a[j], self.dtype) for n, a in captured.items()})
            if thumbs is not None:
                scale, offset = self._denormalise
                hwc = pixel_values.numpy().transpose(0, 2, 3, 1) * scale + offset
                pixels = np.clip(np.rint(hwc), 0, 255).astype(np.uint8)
                thumbs += [png_of_pixels(p) for p in pixels]
        return acts_out, thumbs
