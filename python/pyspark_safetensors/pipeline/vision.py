"""The pipeline on images (``model = "toy-vit"``, ``conf/pipeline-vit.toml``): the toy ViT
and its synthetic image set, and the held-out evaluation of SAEs on a vision classifier.

The evaluation's downstream figure is the vision analogue of an LM's CE loss recovered:
the classifier's cross-entropy and accuracy on held-out images with an SAE's
reconstruction spliced in at its hook point (on the tokens it was trained on: the
patches, or the CLS token), against the same tokens zero- and mean-ablated;
``loss_recovered`` = (CE zero − CE spliced) / (CE zero − CE clean), 1 = as good as the
model, 0 = as bad as zero ablation; KL of the class distributions to the clean ones.
Beside it, SAEBench's sparse probing on the images' known factors: how well k of an SAE's
latents tell each factor's values apart, against the raw activations.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .errors import PipelineError

TOKEN_SETS = ("image", "cls")
"""What an image SAE trains on, as the saev views name it: the patches, or the CLS token."""
POOL_IMAGES = 64
"""Images whose tokens the factor probes encode at once."""


def image_set(out_dir: Path, config, *, images: int, held_out: int) -> None:
    """The toy ViT's image set for a run: ``out_dir/train`` (``images`` of the images the
    model trained on, for the extraction and the SAEs) and ``out_dir/held_out`` (images
    the model never saw, for the evaluation), each PNG files in the ImageFolder layout
    with their ``labels.parquet`` (factors, patch masks)."""
    from ..extract.toy_vit import write_image_set

    write_image_set(out_dir / "train", images, config, split="train")
    write_image_set(out_dir / "held_out", held_out, config, split="held_out")


def held_out_images(directory: Path) -> tuple[list, list[str]]:
    """(PIL images, shape labels) of a ``write_image_set`` directory, in its labels' order."""
    import pyarrow.parquet as pq
    from PIL import Image

    labels = pq.read_table(directory / "labels.parquet", columns=["path", "shape"]).to_pylist()
    images = []
    for row in labels:
        with Image.open(directory / "images" / row["path"]) as image:
            images.append(image.convert("RGB"))
    return images, [row["shape"] for row in labels]


def token_positions(layout, tokens: str) -> slice:
    """The positions of an image's tokens an SAE of ``tokens`` ("image": the patches;
    "cls": the CLS token) reads, in the model's order (``extract.vision.ImageTokens``)."""
    if tokens == "cls":
        if not layout.n_cls:  # SigLIP's towers
            raise PipelineError("this model has no CLS token: set cls_sae = false")
        return slice(0, 1)
    return slice(layout.n_prefix, layout.n_tokens)


@contextmanager
def replaced(module: torch.nn.Module, where: str, positions: slice, fn: Callable):
    """Within the block, the module's input (``where`` "input") or output at ``positions``
    of every image is replaced by ``fn(tokens [images, n, H])``."""

    def swap(x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        x[:, positions] = fn(x[:, positions]).to(x.dtype)
        return x

    if where == "input":
        handle = module.register_forward_pre_hook(lambda m, args: (swap(args[0]), *args[1:]))
    else:

        def post(m, args, output):
            if isinstance(output, tuple):
                return (swap(output[0]), *output[1:])
            return swap(output)

        handle = module.register_forward_hook(post)
    try:
        yield
    finally:
        handle.remove()


def _class_stats(logits: torch.Tensor, labels: torch.Tensor, clean_logp: torch.Tensor | None):
    """(summed CE, correct predictions, summed KL to the clean distributions)."""
    logp = logits.float().log_softmax(-1)
    ce = F.nll_loss(logp, labels, reduction="sum").item()
    correct = (logp.argmax(-1) == labels).sum().item()
    kl = 0.0 if clean_logp is None else F.kl_div(logp, clean_logp, log_target=True,
                                                 reduction="sum").item()  # fmt: skip
    return ce, correct, kl


@torch.inference_mode()
def classifier_evaluation(
    extractor,
    images: list,
    labels: list[str],
    saes: Mapping[str, tuple[str, str, object]],
    acts: Mapping[str, np.ndarray],
    batch_size: int = 64,
) -> dict:
    """The classifier's loss with each SAE spliced in (``saes``: ``{name: (hook, tokens,
    sae)}``, ``tokens`` in ``TOKEN_SETS``), against its tokens zero- and mean-ablated
    (the mean over the held-out images' same tokens, ``acts[hook] [images, tokens, H]``).
    ``extractor``: an ``extract.vision.VisionExtractor`` of an image classifier."""
    model, layout = extractor.model, extractor.layout
    if not type(model).__name__.endswith("ForImageClassification"):
        raise PipelineError(
            "the classifier evaluation needs an image-classification model (its config's "
            "architectures name one, e.g. ViTForImageClassification)"
        )
    label_ids = torch.tensor([model.config.label2id[label] for label in labels])
    pixels = [
        extractor.processor(images=images[i : i + batch_size], return_tensors="pt")["pixel_values"]
        for i in range(0, len(images), batch_size)
    ]
    modules = dict(extractor.tower.named_modules())
    hooks = {h.name: h for h in extractor.hooks}

    def run(clean_logps=None):
        sums, logps, start = np.zeros(3), [], 0
        for i, batch in enumerate(pixels):
            logits = model(pixel_values=batch).logits
            ids = label_ids[start : start + len(batch)]
            start += len(batch)
            sums += _class_stats(logits, ids, None if clean_logps is None else clean_logps[i])
            logps.append(logits.float().log_softmax(-1))
        return sums, logps

    n = len(images)
    clean, clean_logps = run()
    figures = {"images": n, "ce_clean": clean[0] / n, "accuracy_clean": clean[1] / n, "saes": {}}
    for name, (hook_name, tokens, sae) in saes.items():
        hook, positions = hooks[hook_name], token_positions(layout, tokens)
        mean = torch.from_numpy(acts[hook_name][:, positions].astype(np.float32)).mean((0, 1))

        def reconstruct(x, sae=sae):
            flat = x.reshape(-1, x.shape[-1]).float()
            return sae(flat).x_hat.reshape(x.shape)

        variants = {
            "spliced": reconstruct,
            "zero": lambda x: torch.zeros_like(x),
            "mean": lambda x, mean=mean: mean.expand_as(x),
        }
        row = {"hook": hook_name, "tokens": tokens}
        for kind, fn in variants.items():
            with replaced(modules[hook.module], hook.where, positions, fn):
                (ce, correct, kl), _ = run(clean_logps)
            label = {"zero": "zero_ablated", "mean": "mean_ablated"}.get(kind, kind)
            row |= {f"ce_{label}": ce / n, f"accuracy_{label}": correct / n, f"kl_{label}": kl / n}
        for against in ("zero", "mean"):
            gap = row[f"ce_{against}_ablated"] - figures["ce_clean"]
            recovered = (
                (row[f"ce_{against}_ablated"] - row["ce_spliced"]) / gap if gap else float("nan")
            )
            row["loss_recovered" + ("" if against == "zero" else "_mean")] = recovered
        figures["saes"][name] = row
    return figures


def factor_probing(
    acts: Mapping[str, np.ndarray],
    saes: Mapping[str, tuple[str, str, object]],
    layout,
    factors: Mapping[str, list],
    *,
    min_positives: int = 5,
    seed: int = 0,
) -> dict:
    """SAEBench's sparse probing (``evaluation.probing``) of each SAE on the held-out
    images' factors: one task per factor value ("is the shape red", one against the rest,
    balanced), each image its tokens' mean (the patches an SAE reads, or its CLS token),
    the SAE's latents pooled the same way; the first half of the images train the probes,
    the second half test them. Beside each SAE, the same probes on its tokens' raw
    activations (SAEBench's baseline). ``saes``: ``{name: (hook, tokens, sae)}``;
    ``acts[hook] [images, tokens, H]``; ``factors``: ``{factor: a value per image}``."""
    from ..evaluation.probing import dense_codes, factor_probe_tasks, probe_tasks

    n = len(next(iter(acts.values())))
    tasks, skipped = factor_probe_tasks(factors, train_examples=n // 2,
                                        min_positives=min_positives, seed=seed)  # fmt: skip
    out = {"images": n, "train_images": n // 2, "tasks": [t.name for t in tasks],
           "skipped": skipped, "saes": {}}  # fmt: skip
    if not tasks:
        return out
    baselines: dict[tuple[str, str], dict] = {}
    for name, (hook, tokens, sae) in saes.items():
        x = torch.from_numpy(acts[hook][:, token_positions(layout, tokens)].astype(np.float32))
        # a few images' codes at a time: [images, tokens, latents] whole could be large
        pooled = torch.cat([dense_codes(sae, part.reshape(-1, part.shape[-1]))
                            .reshape(len(part), part.shape[1], -1).mean(1)
                            for part in x.split(POOL_IMAGES)])  # fmt: skip
        if (hook, tokens) not in baselines:
            baselines[hook, tokens] = probe_tasks(x.mean(1), tasks)
        out["saes"][name] = {"hook": hook, "tokens": tokens,
                             "sae": probe_tasks(pooled, tasks),
                             "activations": baselines[hook, tokens]}  # fmt: skip
    return out


def held_out_factors(directory: Path) -> dict[str, list]:
    """``{factor: a value per image}`` of a ``write_image_set`` directory, in its labels'
    order (the factors of ``extract.toy_vit.FACTORS`` it holds)."""
    import pyarrow.parquet as pq

    from ..extract.toy_vit import FACTORS

    table = pq.read_table(directory / "labels.parquet")
    return {f: table.column(f).to_pylist() for f in FACTORS if f in table.column_names}


def evaluate_vision(
    *,
    model_dir: str | os.PathLike,
    held_out_dir: Path,
    saes: Mapping[str, tuple[str, str, Path]],
    out_dir: Path,
) -> dict:
    """Every held-out figure of an image run: each SAE's FVU, L0, dead and dense latents on
    the held-out images' tokens it reads (``saes``: ``{name: (hook, tokens, file)}``), the
    classifier with each spliced in (``classifier_evaluation``), and sparse probing of the
    image factors (``factor_probing``); writes
    ``latent_frequency.png`` into ``out_dir``."""
    from ..extract.vision import VisionExtractor
    from ..sae import load_sae_model
    from .evaluation import plot_frequencies, sae_figures

    images, labels = held_out_images(held_out_dir)
    hooks = list(dict.fromkeys(hook for hook, _, _ in saes.values()))
    extractor = VisionExtractor(model_dir, hooks, dtype="F32")
    per_image, _ = extractor.run(images)
    acts = {hook: np.stack([a[hook] for a in per_image]) for hook in hooks}
    figures, freqs, loaded = {}, {}, {}
    for name, (hook, tokens, path) in saes.items():
        x = acts[hook][:, token_positions(extractor.layout, tokens)]
        x = torch.from_numpy(x.reshape(-1, x.shape[-1]).astype(np.float32))
        figures[name], freqs[name] = sae_figures(path, x)
        loaded[name] = (hook, tokens, load_sae_model(path).eval())
    # the fewest tokens any SAE was measured on: a CLS SAE's, one per image
    plot_frequencies(freqs, len(images), out_dir / "latent_frequency.png")
    classifier = classifier_evaluation(extractor, images, labels, loaded, acts)
    probing = factor_probing(acts, loaded, extractor.layout, held_out_factors(held_out_dir))
    return {
        "held_out_images": len(images),
        "token_layout": extractor.layout.to_dict(),
        "sae": figures,
        "classifier": classifier,
        "probing": probing,
    }
