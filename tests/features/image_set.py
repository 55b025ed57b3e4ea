"""A small image extraction in the contract's layout, made in the test: shapes drawn with
PIL (a circle or a square, red or blue, on a grey background), and for each token an
activation that says what its patch holds (the fraction of its pixels in a circle, in a
square, red, blue; CLS and register tokens their own direction), so that an SAE whose
latents read those directions has known detectors. The extraction directory holds what
an image extraction writes: ``extraction.json`` (``modality`` "image", the patch grid,
the registers), ``images.parquet`` (with PNG thumbnails) and the hook point's token
dataset (``activation``, ``sample_id``, ``token_pos``, ``image_id``, ``patch_row``,
``patch_col``, ``layer``)."""

from __future__ import annotations

import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

HOOK = "vit.encoder.layer.1:output"
SIZE, PATCH, REGISTERS, WIDTH = 32, 8, 1, 12
GRID = SIZE // PATCH
TOKENS = 1 + REGISTERS + GRID * GRID
COLOURS = {"red": (220, 30, 30), "blue": (30, 60, 220)}
DIRECTIONS = ("circle", "square", "red", "blue", "cls", "register", "background")


def draw(rng):
    """One image: (PIL image, its factors, its shape's pixel mask)."""
    from PIL import Image, ImageDraw

    shape, colour = rng.choice(["circle", "square"]), rng.choice(list(COLOURS))
    grey = int(rng.integers(90, 200))
    size = int(rng.integers(12, 20))
    x, y = (int(v) for v in rng.integers(0, SIZE - size, 2))
    image = Image.new("RGB", (SIZE, SIZE), (grey, grey, grey))
    mask = Image.new("L", (SIZE, SIZE), 0)
    for canvas, fill in ((ImageDraw.Draw(image), COLOURS[colour]), (ImageDraw.Draw(mask), 255)):
        box = [x, y, x + size - 1, y + size - 1]
        (canvas.ellipse if shape == "circle" else canvas.rectangle)(box, fill=fill)
    return image, {"shape": shape, "colour": colour, "background": grey}, np.asarray(mask) > 0


def patch_fractions(mask: np.ndarray) -> np.ndarray:
    """``[GRID, GRID]``: the fraction of each patch's pixels inside the shape."""
    return mask.reshape(GRID, PATCH, GRID, PATCH).mean((1, 3))


def token_activations(factors: dict, mask: np.ndarray, rng) -> np.ndarray:
    """``[TOKENS, WIDTH]``: CLS, the register, then the patches row-major."""
    x = rng.normal(0, 0.03, (TOKENS, WIDTH)).astype(np.float32)
    d = {name: i for i, name in enumerate(DIRECTIONS)}
    x[0, d["cls"]] += 1.0 + 0.5 * (factors["shape"] == "circle")
    x[1, d["register"]] += 1.0
    inside = patch_fractions(mask).reshape(-1)
    patches = x[1 + REGISTERS :]
    patches[:, d[factors["shape"]]] += 1.5 * inside
    patches[:, d[factors["colour"]]] += 1.2 * inside
    patches[:, d["background"]] += (1 - inside) * factors["background"] / 255
    return x


def write_image_extraction(out, n: int = 24, seed: int = 0):
    """The extraction at ``out``; returns the per-patch factor table (``image_id``,
    ``patch_row``, ``patch_col``, ``shape``, ``colour``: null outside the shape, a patch
    being inside when half its pixels are)."""
    from pyspark_safetensors.dataset import write_batch_dataset

    rng = np.random.default_rng(seed)
    out.mkdir(parents=True)
    acts, images, labels = [], [], []
    for image_id in range(n):
        image, factors, mask = draw(rng)
        acts.append(token_activations(factors, mask, rng))
        png = io.BytesIO()
        image.save(png, format="PNG")
        images.append({"image_id": image_id, "key": f"img-{image_id:03d}.png",
                       "path": f"/data/img-{image_id:03d}.png",
                       "label": f"{factors['colour']} {factors['shape']}", "width": SIZE,
                       "height": SIZE, "thumbnail": png.getvalue()})  # fmt: skip
        inside = patch_fractions(mask) >= 0.5
        for r in range(GRID):
            for c in range(GRID):
                labels.append({"image_id": image_id, "patch_row": r, "patch_col": c,
                               "shape": factors["shape"] if inside[r, c] else None,
                               "colour": factors["colour"] if inside[r, c] else None})  # fmt: skip
    pos = np.tile(np.arange(TOKENS), n)
    patch = pos - 1 - REGISTERS
    columns = {
        "activation": np.concatenate(acts),
        "sample_id": np.repeat(np.arange(n, dtype=np.int64), TOKENS),
        "token_pos": pos.astype(np.int32),
        "image_id": np.repeat(np.arange(n, dtype=np.int64), TOKENS),
        "patch_row": np.where(patch >= 0, patch // GRID, -1).astype(np.int32),
        "patch_col": np.where(patch >= 0, patch % GRID, -1).astype(np.int32),
        "layer": np.full(n * TOKENS, 1, np.int32),
    }
    dataset = "activations/vit.encoder.layer.1.output"
    write_batch_dataset(out / dataset, columns, rows_per_shard=100)  # shards cut images
    pq.write_table(pa.Table.from_pylist(images), out / "images.parquet")
    doc = {"config": {"images": "/data"}, "model_dir": "", "modality": "image",
           "patch_grid": [GRID, GRID], "patch_size": PATCH, "image_size": [SIZE, SIZE],
           "n_registers": REGISTERS, "hooks": {HOOK: {"dataset": dataset, "width": WIDTH}}}  # fmt: skip
    (out / "extraction.json").write_text(json.dumps(doc))
    table = pa.Table.from_pylist(labels)
    pq.write_table(table, out / "factors.parquet")
    return table


def direction_sae(path, extra: int = 5, k: int = 3, seed: int = 0):
    """An SAE whose first latents read ``DIRECTIONS`` (latent i: direction i), then
    ``extra`` random ones."""
    from pyspark_safetensors.sae import save_sae

    gen = torch.Generator().manual_seed(seed)
    rows = torch.zeros(len(DIRECTIONS) + extra, WIDTH)
    rows[: len(DIRECTIONS), : len(DIRECTIONS)] = torch.eye(len(DIRECTIONS))
    rows[len(DIRECTIONS) :] = torch.randn(extra, WIDTH, generator=gen)
    rows /= rows.norm(dim=1, keepdim=True)
    tensors = {"encoder_weight": rows.clone(), "encoder_bias": torch.full((len(rows),), -0.1),
               "decoder_weight": rows, "decoder_bias": torch.zeros(WIDTH)}  # fmt: skip
    save_sae(path, tensors, {"k": str(k), "hook_point": HOOK})
    return path
