"""A small vision transformer trained here, offline, on a synthetic image set whose
generative factors are known: the vision counterpart of ``toy_lm``.

Each image is drawn with PIL from its index and the seed alone (the same pixels on every
machine): one shape (circle, square, triangle) of a colour, a texture (solid,
stripes, dots) and a size, at a position, on a background (dark, light, noise). Every
image keeps its factors and which patches of the model's grid the shape covers (the
ground truth for a latent that detects a factor patch by patch).

A ``transformers`` ``ViTForImageClassification`` (patch 8 on 32-pixel images: a 4 x 4
grid and a CLS token) learns the shape from the first ``n_train`` images (mirrored at
random), seeded and on the CPU. A head used in training only asks each patch token of the
last layer whether it lies inside the shape and which shape it is, so that the patches, not
only CLS, carry the factors an SAE of them should find. The model is saved with its
``ViTImageProcessor`` as an ordinary model directory
(``AutoModel``/``AutoImageProcessor.from_pretrained`` load it; so does the extraction).
``toy_vit.json`` in it records the config and the accuracy on held-out images (the ones
after the training images) beside chance.

    model = toy_vit("out/models", TINY_VIT)            # trained once, then reused
    labels = write_image_set("out/shapes", 64, TINY_VIT)  # held-out PNGs + labels.parquet
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .model import ExtractionError

RECORD = "toy_vit.json"
"""Written into the model directory: config, content hash, accuracies."""
LABELS = "labels.parquet"
"""Beside the ``images/`` folder ``write_image_set`` writes: one row per image."""

SHAPES = ("circle", "square", "triangle")
COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (50, 80, 230),
           "yellow": (230, 210, 40)}  # fmt: skip
TEXTURES = ("solid", "stripes", "dots")
SIZES = ("small", "large")
BACKGROUNDS = ("dark", "light", "noise")
FACTORS = ("shape", "colour", "texture", "size", "background")
"""The categorical factors (position is ``x``, ``y``: the shape's centre in pixels)."""
MASK_COVERAGE = 0.5
"""A patch lies inside the shape when the shape covers at least this fraction of it."""


@dataclass(frozen=True)
class ToyViTConfig:
    """What a toy vision model is: its image set, architecture and training run."""

    image_size: int = 32
    patch_size: int = 8
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    n_train: int = 4000
    """Images 0 .. n_train-1 train the model; the ones after are held out."""
    n_held_out: int = 500
    """Held-out images the record's accuracy is measured on."""
    steps: int = 2000
    batch_size: int = 64
    learning_rate: float = 2e-3
    warmup_steps: int = 30
    weight_decay: float = 0.01
    patch_loss: float = 1.0
    """Weight of the training-only per-patch objective (0: none): a linear head on each
    patch token of the last layer predicts "outside" or the shape the patch lies inside."""
    flip: bool = True
    """Mirror each training image left to right with probability 1/2 (seeded): every
    shape is symmetric so (stripes then run the other way), and it doubles the images
    seen (held-out accuracy after 1000 steps on 2000 images: 0.75 without, 0.90 with)."""
    seed: int = 0

    def __post_init__(self):
        if self.image_size % self.patch_size:
            raise ExtractionError(
                f"image_size {self.image_size} is not a multiple of patch_size {self.patch_size}"
            )

    @property
    def grid(self) -> int:
        """Patches per side."""
        return self.image_size // self.patch_size


TINY_VIT = ToyViTConfig(n_train=2000, n_held_out=200, steps=1000, warmup_steps=20)
"""A config that trains in seconds (tests, the docs' examples): 0.90 held-out accuracy
against 0.33 chance (the default: 0.93). Fewer steps are no cheaper way there: at 800
steps it reached 0.74, at 500 0.61."""


# -- the image set ---------------------------------------------------------------------------


def draw_image(index: int, config: ToyViTConfig = ToyViTConfig()):
    """(RGB PIL image, factors, patch coverage [grid, grid]) of image ``index``: drawn from
    ``(seed, index)`` alone."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng([config.seed, index])
    n = config.image_size
    shape = SHAPES[rng.integers(len(SHAPES))]
    colour = list(COLOURS)[rng.integers(len(COLOURS))]
    texture = TEXTURES[rng.integers(len(TEXTURES))]
    size = SIZES[rng.integers(len(SIZES))]
    background = BACKGROUNDS[rng.integers(len(BACKGROUNDS))]
    radius = n * (rng.uniform(0.2, 0.26) if size == "small" else rng.uniform(0.32, 0.4))
    x = rng.uniform(radius, n - radius)
    y = rng.uniform(radius, n - radius)

    if background == "noise":
        pixels = rng.integers(90, 160, (n, n, 3), dtype=np.uint8)
        image = Image.fromarray(pixels)
    else:
        image = Image.new("RGB", (n, n), (25, 25, 30) if background == "dark" else (225, 225, 220))
    mask = Image.new("L", (n, n), 0)
    outline = {
        "circle": None,
        "square": [(x - radius * 0.85, y - radius * 0.85), (x + radius * 0.85, y + radius * 0.85)],
        "triangle": [(x, y - radius), (x - radius * 0.95, y + radius * 0.8),
                     (x + radius * 0.95, y + radius * 0.8)],
    }[shape]  # fmt: skip
    draw = ImageDraw.Draw(mask)
    if shape == "circle":
        draw.ellipse([x - radius, y - radius, x + radius, y + radius], fill=255)
    elif shape == "square":
        draw.rectangle(outline, fill=255)
    else:
        draw.polygon(outline, fill=255)

    rgb = np.array(COLOURS[colour], np.uint8)
    fill = np.broadcast_to(rgb, (n, n, 3)).copy()
    rows, cols = np.mgrid[0:n, 0:n]
    marks = rgb // 2 + 64  # the texture's second tone: the colour, paler
    if texture == "stripes":
        fill[(rows + cols) // 3 % 2 == 1] = marks
    elif texture == "dots":
        fill[(rows % 4 < 2) & (cols % 4 < 2)] = marks
    image.paste(Image.fromarray(fill), (0, 0), mask)

    inside = np.asarray(mask, np.float32) / 255
    g, p = config.grid, config.patch_size
    coverage = inside.reshape(g, p, g, p).mean(axis=(1, 3))
    factors = {"shape": shape, "colour": colour, "texture": texture, "size": size,
               "background": background, "x": float(x), "y": float(y)}  # fmt: skip
    return image, factors, coverage


def write_image_set(
    out_dir: str | os.PathLike,
    n_images: int,
    config: ToyViTConfig = ToyViTConfig(),
    *,
    split: str = "held_out",
) -> Path:
    """``n_images`` images as PNG files ``out_dir/images/{shape}/{index:06d}.png`` (the
    ImageFolder layout: the folder is the label) and ``out_dir/labels.parquet``: ``path``
    (relative to ``images/``, as an extraction of that folder keys it), ``index``, the
    factors, ``patch_coverage`` (the fraction of each patch the shape covers, row-major)
    and ``patch_mask`` (coverage >= ``MASK_COVERAGE``). ``split``: "held_out" (images the
    model never trained on) or "train". Returns the labels path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if split not in ("held_out", "train"):
        raise ExtractionError(f"split must be 'held_out' or 'train', got {split!r}")
    first = config.n_train if split == "held_out" else 0
    root = Path(out_dir)
    rows = []
    for index in range(first, first + n_images):
        image, factors, coverage = draw_image(index, config)
        rel = f"{factors['shape']}/{index:06d}.png"
        (root / "images" / factors["shape"]).mkdir(parents=True, exist_ok=True)
        image.save(root / "images" / rel)
        rows.append({"path": rel, "index": index, **factors,
                     "patch_coverage": coverage.reshape(-1).tolist(),
                     "patch_mask": (coverage >= MASK_COVERAGE).reshape(-1).tolist()})  # fmt: skip
    table = pa.Table.from_pylist(rows).replace_schema_metadata(
        {"grid": json.dumps([config.grid, config.grid]), "patch_size": str(config.patch_size)}
    )
    pq.write_table(table, root / LABELS)
    return root / LABELS


# -- the model -------------------------------------------------------------------------------


def toy_vit_hash(config: ToyViTConfig = ToyViTConfig()) -> str:
    """sha256 of the config (the images are a function of it)."""
    body = {**dataclasses.asdict(config), "kind": "vit", "shapes": SHAPES}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def toy_vit(
    root: str | os.PathLike, config: ToyViTConfig = ToyViTConfig(), *, progress: bool = False
) -> Path:
    """The model directory ``root/toy-vit-{hash[:16]}``: trained and published whole the
    first time (or copied from ``$PYSPARK_SAFETENSORS_TOY_CACHE``, as ``toy_lm``'s), reused
    afterwards (its ``toy_vit.json`` records the accuracies)."""
    from .toy_lm import cached_toy

    digest = toy_vit_hash(config)
    final = Path(root) / f"toy-vit-{digest[:16]}"
    if (final / RECORD).is_file():
        return final
    return cached_toy(
        final, f"toy-vit-{digest}", lambda d: train_toy_vit(d, config, progress=progress)
    )


def image_processor(config: ToyViTConfig):
    """The model's ``ViTImageProcessor``: resize to ``image_size``, scale to [-1, 1]."""
    from transformers import ViTImageProcessor

    size = {"height": config.image_size, "width": config.image_size}
    return ViTImageProcessor(size=size, image_mean=[0.5] * 3, image_std=[0.5] * 3)


def _tensors(config: ToyViTConfig, first: int, count: int):
    """(pixel values [count, 3, n, n] scaled as the processor does, shape labels, patch
    labels [count, grid * grid]: 0 outside the shape, 1 + the shape's label inside)."""
    import torch

    images, labels, patches = [], [], []
    for index in range(first, first + count):
        image, factors, coverage = draw_image(index, config)
        images.append(np.asarray(image))
        labels.append(SHAPES.index(factors["shape"]))
        patches.append((coverage.reshape(-1) >= MASK_COVERAGE) * (1 + labels[-1]))
    # the processor's own arithmetic (the images are already image_size: no resize)
    pixels = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float() / 255
    return (pixels - 0.5) / 0.5, torch.tensor(labels), torch.from_numpy(np.stack(patches))


def train_toy_vit(
    out_dir: str | os.PathLike, config: ToyViTConfig = ToyViTConfig(), *, progress: bool = False
) -> dict:
    """Train the classifier on images ``0 .. n_train-1`` and save it with its image
    processor into ``out_dir``; returns what ``toy_vit.json`` records (and the seconds).
    Same config, same machine: the same bytes."""
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    started = time.perf_counter()
    threads = torch.get_num_threads()
    # one thread: a model this small gains nothing from more (on a busy machine, several
    # threads' spinning made a step 20x slower), and one order of float sums everywhere
    torch.set_num_threads(1)
    try:
        return _train_and_save(Path(out_dir), config, progress, started)
    finally:
        torch.set_num_threads(threads)


def _train_and_save(out_dir: Path, config: ToyViTConfig, progress: bool, started: float) -> dict:
    import torch
    from transformers import ViTConfig, ViTForImageClassification

    train_x, train_y, train_patches = _tensors(config, 0, config.n_train)
    test_x, test_y, _ = _tensors(config, config.n_train, config.n_held_out)
    torch.manual_seed(config.seed)
    model = ViTForImageClassification(ViTConfig(
        image_size=config.image_size, patch_size=config.patch_size,
        hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        num_labels=len(SHAPES), id2label=dict(enumerate(SHAPES)),
        label2id={s: i for i, s in enumerate(SHAPES)},
    ))  # fmt: skip
    losses = _train(model, train_x, train_y, train_patches, config, progress)
    model.eval()
    record = {
        "config": dataclasses.asdict(config),
        "hash": toy_vit_hash(config),
        "task": "shape",
        "labels": list(SHAPES),
        "parameters": sum(p.numel() for p in model.parameters()),
        "final_train_loss": losses[-1],
        "train_accuracy": accuracy(model, train_x, train_y),
        "held_out_accuracy": accuracy(model, test_x, test_y),
        "chance_accuracy": 1 / len(SHAPES),
        "seconds": time.perf_counter() - started,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    image_processor(config).save_pretrained(out_dir)
    saved = {k: v for k, v in record.items() if k != "seconds"}  # not part of the model
    (out_dir / RECORD).write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    return record


def _train(model, x, y, patches, config: ToyViTConfig, progress: bool) -> list[float]:
    """AdamW, linear warm-up then cosine decay; batches drawn by a seeded generator. The
    loss is the classifier's plus ``patch_loss`` times the per-patch head's: without it the
    CLS token learns the shape but the patch tokens need not carry it (a patch-level probe
    of the last layer separated the shapes at 0.65-0.76 AUROC)."""
    import torch
    import torch.nn.functional as F
    from tqdm.auto import tqdm

    gen = torch.Generator().manual_seed(config.seed)
    # the per-patch head trains beside the model and is thrown away: not part of the model
    head = torch.nn.Linear(config.hidden_size, 1 + len(SHAPES))
    params = [*model.parameters(), *head.parameters()]
    # fused: the same bits on every CPU (as ``toy_lm``'s)
    opt = torch.optim.AdamW(
        params, lr=config.learning_rate, weight_decay=config.weight_decay, fused=True
    )

    def lr_at(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        done = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * done))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    model.train()
    losses = []
    for _ in tqdm(range(config.steps), desc="toy ViT", unit="step", disable=not progress):
        pick = torch.randint(len(x), (config.batch_size,), generator=gen)
        xb, pb = x[pick], patches[pick].view(-1, config.grid, config.grid)
        if config.flip:
            mirror = torch.rand(len(pick), generator=gen) < 0.5
            xb = torch.where(mirror[:, None, None, None], xb.flip(-1), xb)
            pb = torch.where(mirror[:, None, None], pb.flip(-1), pb)
        out = model(pixel_values=xb, output_hidden_states=config.patch_loss > 0)
        loss = F.cross_entropy(out.logits, y[pick])
        if config.patch_loss > 0:  # the last layer's patch tokens, as a hook on it sees them
            per_patch = head(out.hidden_states[-1][:, 1:]).flatten(0, 1)
            loss = loss + config.patch_loss * F.cross_entropy(per_patch, pb.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
    return losses


def accuracy(model, x, y, batch_size: int = 256) -> float:
    """The fraction of images whose most likely class is their label."""
    import torch

    right = 0
    with torch.inference_mode():
        for start in range(0, len(x), batch_size):
            logits = model(pixel_values=x[start : start + batch_size]).logits
            right += int((logits.argmax(-1) == y[start : start + batch_size]).sum())
    return right / len(x)
