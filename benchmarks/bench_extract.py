"""Extraction against the loop a researcher would write: the CLI's ``extract`` with its
defaults (embedded ``local[*]`` Spark, MiniLM, two hook points, F16) and a plain Python
loop over the same texts that runs the same model with the same windows and batches
(``Extractor``) and writes the same F16 token-level shards (safetensors files of
``rows_per_shard`` tokens per hook point). Each is a fresh process, timed from its start
to its exit, with the machine's busy CPU seconds over the same span (``/proc/stat``).

Three corpora: 400 demo passages, the whole demo corpus, and a larger local text (the
demo corpus cut four ways into passages, as a parquet table: the path a user's own
corpus takes). A straight line through each side's three times gives its fixed cost and
its per-token slope; the slopes' ratio is where the job's ratio to the loop tends on
larger corpora. The job's writes the loop does not make (the KV dataset) are timed apart.

Images (``python -m benchmarks.bench_extract --images [--small] [N ...]``, also part of
``run``): the CLI's ``extract --images`` on folders of the toy ViT's synthetic PNGs against
a plain loop over the same files (``VisionExtractor``: the same model, batches, hook points
and F16 token shards with the image columns, and ``images.parquet`` with the thumbnails;
the job's KV dataset off), the same fit of fixed cost and per-image slope; with the toy
ViT (a forward pass of 0.3 ms per image: the job's own costs show) and with ``SMALL_VIT``
(ViT-Small's width, random weights).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from .common import table

DEMO_TEXTS = 400
LARGE_CUTS = (400, 300, 500, 350)
"""Passage sizes of the larger corpus: the demo corpus cut four ways (distinct texts)."""
TEXTS_PER_CALL = 256
"""Texts per ``Extractor.run`` in the loop: the job's texts per model call too
(``MODEL_BATCHES_PER_OUTPUT_BATCH`` x batch_size), so both sort the same spans by length."""


def _busy_cpu_seconds() -> float:
    """The machine's busy CPU seconds so far (every core; idle and iowait left out)."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def _timed(argv: list[str]) -> tuple[float, float]:
    """(wall seconds, busy CPU seconds) of a fresh process from its start to its exit."""
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}
    os.sync()
    cpu, start = _busy_cpu_seconds(), time.perf_counter()
    subprocess.run(argv, env=env, check=True, capture_output=True)
    return time.perf_counter() - start, _busy_cpu_seconds() - cpu


def _corpus_texts(corpus: str, max_texts: int) -> list[str]:
    """The texts the job takes, in its order (by key): duplicates and blanks dropped."""
    import pyarrow.parquet as pq

    from pyspark_safetensors.extract import passages_by_key
    from pyspark_safetensors.extract.corpus import text_key

    if corpus == "demo":
        return passages_by_key(0, max_texts or 1 << 30)
    texts = {t for t in pq.read_table(corpus).column("text").to_pylist() if t and t.strip()}
    return sorted(texts, key=text_key)[: max_texts or None]


def loop(corpus: str, out: str, max_texts: int) -> None:
    """The researcher's loop: the model over the texts, F16 token shards per hook point."""
    from safetensors.numpy import save_file

    from pyspark_safetensors.extract import ExtractConfig, Extractor, default_model_dir

    config = ExtractConfig()
    texts = _corpus_texts(corpus, max_texts)
    extractor = Extractor(
        default_model_dir(), list(config.hooks), max_length=config.max_length,
        batch_size=config.batch_size, dtype=config.dtype,
    )  # fmt: skip
    pending = {h.name: [] for h in extractor.hooks}
    ids, positions, shards, buffered = [], [], 0, 0

    def flush():
        nonlocal ids, positions, shards, buffered
        for hook in extractor.hooks:
            folder = Path(out) / hook.column
            folder.mkdir(parents=True, exist_ok=True)
            tensors = {
                "activation": np.concatenate(pending[hook.name]),
                "sample_id": np.concatenate(ids),
                "token_pos": np.concatenate(positions),
            }
            save_file(tensors, str(folder / f"part-{shards:05d}.safetensors"))
            pending[hook.name] = []
        ids, positions, shards, buffered = [], [], shards + 1, 0

    tokens = 0
    for start in range(0, len(texts), TEXTS_PER_CALL):
        for window in extractor.run(texts[start : start + TEXTS_PER_CALL]):
            for name, activation in window.activations.items():
                pending[name].append(activation)
            ids.append(np.full(window.seq_len, start + window.text_index, np.int64))
            positions.append(window.first_pos + np.arange(window.seq_len, dtype=np.int32))
            buffered += window.seq_len
            tokens += window.seq_len
            if buffered >= config.rows_per_shard:
                flush()
    if buffered:
        flush()
    Path(out, "tokens").write_text(str(tokens))


IMAGE_COUNTS = (1000, 10000, 100000)
"""Images per folder of the image case (a small configuration: two cores, shared)."""


def image_loop(folder: str, model: str, out: str) -> None:
    """The researcher's loop over a folder of images: files in key order (relative path),
    unreadable ones left out, the model on batches, F16 token shards per hook point with
    the image columns, and an images table with thumbnails."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from safetensors.numpy import save_file

    from pyspark_safetensors.extract import ExtractConfig
    from pyspark_safetensors.extract.vision import VisionExtractor, decode_image

    config = ExtractConfig()
    root = Path(folder)
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    extractor = VisionExtractor(model, list(config.hooks), batch_size=config.batch_size,
                                dtype=config.dtype)  # fmt: skip
    layout = extractor.layout
    per_image = {"patch_row": layout.patch_rows(), "patch_col": layout.patch_cols(),
                 "token_kind": layout.kinds()}  # fmt: skip
    pending = {h.name: [] for h in extractor.hooks}
    table, shards, image_id = [], 0, 0
    rows_per_shard = config.rows_per_shard // layout.n_tokens * layout.n_tokens

    def flush(ids):
        nonlocal shards
        n = len(ids)
        for hook in extractor.hooks:
            folder = Path(out) / hook.column
            folder.mkdir(parents=True, exist_ok=True)
            tensors = {
                "activation": np.concatenate(pending[hook.name]),
                "sample_id": np.repeat(np.asarray(ids, np.int64), layout.n_tokens),
                "token_pos": np.tile(np.arange(layout.n_tokens, dtype=np.int32), n),
                **{k: np.tile(v, n) for k, v in per_image.items()},
            }
            save_file(tensors, str(folder / f"part-{shards:05d}.safetensors"))
            pending[hook.name] = []
        shards += 1

    ids = []
    for start in range(0, len(files), TEXTS_PER_CALL):
        images, names = [], []
        for name in files[start : start + TEXTS_PER_CALL]:
            try:
                images.append(decode_image((root / name).read_bytes()))
                names.append(name)
            except (OSError, ValueError, SyntaxError) as e:  # PIL's errors of a bad file
                print(f"  skipped {name}: {e}")  # left out, as the job's "skip" does
        acts, thumbs = extractor.run(images, thumbnails=True)
        for name, image, a, thumb in zip(names, images, acts, thumbs, strict=True):
            for hook, activation in a.items():
                pending[hook].append(activation)
            table.append((image_id, name, *image.size, thumb))
            ids.append(image_id)
            image_id += 1
            if len(ids) * layout.n_tokens >= rows_per_shard:
                flush(ids)
                ids = []
    if ids:
        flush(ids)
    columns = list(zip(*table, strict=True))
    pq.write_table(pa.table({"image_id": columns[0], "key": columns[1], "width": columns[2],
                             "height": columns[3], "thumbnail": columns[4]}),
                   str(Path(out) / "images.parquet"))  # fmt: skip
    Path(out, "tokens").write_text(str(image_id * layout.n_tokens))


def _image_pair(folder: Path, model: Path, tmp: Path, name: str) -> dict:
    """The loop's and the job's runs on one folder of images, equal token counts checked."""
    python = sys.executable
    loop_s, loop_cpu = _timed([python, "-m", "benchmarks.bench_extract", "--image-loop",
                               str(folder), str(model), str(tmp / f"{name}-loop")])  # fmt: skip
    cli = [python, "-m", "pyspark_safetensors.cli", "extract", "--images", str(folder),
           "--model", str(model), "--no-kv-dataset", "--out", str(tmp / f"{name}-job")]  # fmt: skip
    job_s, job_cpu = _timed(cli)
    doc = json.loads((tmp / f"{name}-job" / "extraction.json").read_text())["summary"]
    tokens = int((tmp / f"{name}-loop" / "tokens").read_text())
    if tokens != doc["tokens"]:
        raise RuntimeError(f"{name}: the loop stored {tokens} tokens, the job {doc['tokens']}")
    return {"images": doc["texts"], "tokens": tokens, "loop_s": loop_s, "loop_cpu": loop_cpu,
            "job_s": job_s, "job_cpu": job_cpu, "model_s": doc["seconds"]}  # fmt: skip


def _image_set(folder: Path, count: int) -> Path:
    """The folder of ``count`` held-out toy-ViT images, drawn once (published whole)."""
    from pyspark_safetensors.extract.toy_vit import ToyViTConfig, write_image_set

    if not folder.exists():
        staging = folder.with_name(folder.name + f".{os.getpid()}")
        write_image_set(staging, count, ToyViTConfig())
        staging.rename(folder)
    return folder / "images"


SMALL_VIT = {"image_size": 96, "patch_size": 16, "hidden_size": 384, "num_hidden_layers": 4,
             "num_attention_heads": 6, "intermediate_size": 1536}  # fmt: skip
"""The second model of the image case: ViT-Small's width (384, 6 heads) over 96-pixel
inputs in 36 patches of 16, 4 blocks, random weights (speed does not depend on them): about
7x the toy ViT's compute per image, a model whose forward pass costs more than the job's
per-image bookkeeping, as a real one does."""
SMALL_VIT_COUNTS = (2000, 10000)


def _small_vit(cache: Path) -> Path:
    """``SMALL_VIT`` as a model directory with its image processor, made once."""
    folder = (
        cache
        / f"small-vit-{hashlib.sha256(json.dumps(SMALL_VIT, sort_keys=True).encode()).hexdigest()[:16]}"
    )
    if not folder.exists():
        import torch
        from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor

        torch.manual_seed(0)
        staging = folder.with_name(folder.name + f".{os.getpid()}")
        ViTForImageClassification(ViTConfig(**SMALL_VIT, num_labels=3)).save_pretrained(staging)
        size = SMALL_VIT["image_size"]
        ViTImageProcessor(size={"height": size, "width": size}).save_pretrained(staging)
        staging.rename(folder)
    return folder


def run_images(counts: tuple[int, ...] = IMAGE_COUNTS, model: str = "toy") -> str:
    """The image case over folders of ``counts`` toy-ViT images: ``model`` "toy" (the
    default toy ViT) or "small" (``SMALL_VIT``)."""
    from pyspark_safetensors.extract.toy_vit import ToyViTConfig, toy_vit, toy_vit_hash

    # the models made once and the image sets drawn once, kept between runs (100,000
    # images: minutes of CPU and 400 MB)
    cache = Path(tempfile.gettempdir()) / "pyspark-safetensors-bench"
    path = toy_vit(cache, ToyViTConfig()) if model == "toy" else _small_vit(cache)
    with tempfile.TemporaryDirectory(prefix="bench-extract-images-") as tmp:
        tmp = Path(tmp)
        runs = {}
        for count in counts:
            print(f"   {count} images, {model} model", flush=True)
            images = _image_set(cache / f"images-{toy_vit_hash()[:16]}-{count}", count)
            runs[count] = _image_pair(images, path, tmp, f"i{count}")
    rows = [
        [f"{r['images']:,}", f"{r['tokens']:,}", f"{r['loop_s']:.1f}", f"{r['job_s']:.1f}",
         f"{r['model_s']:.1f}", f"{r['loop_s'] / r['job_s']:.2f}x",
         f"{r['loop_cpu']:.0f} / {r['job_cpu']:.0f}"]
        for r in runs.values()
    ]  # fmt: skip
    images = [r["images"] for r in runs.values()]
    fits = {who: _fit(images, [r[f"{who}_s"] for r in runs.values()]) for who in ("loop", "job")}
    lines = [[who, f"{fixed:.1f} s", f"{slope * 1e3:.2f} ms", f"{1 / slope:,.0f}"]
             for who, (fixed, slope) in fits.items()]  # fmt: skip
    header = ["images", "tokens", "loop s", "job s", "job's model stage s",
              "job / loop (images/s)", "CPU s loop / job"]  # fmt: skip
    what = (
        "the default toy ViT: 32-pixel PNGs, patch 8, 17 tokens per image, 2 blocks of width 64"
        if model == "toy"
        else "a ViT of ViT-Small's width, random weights: the same PNGs resized to 96 pixels, "
        "patch 16, 37 tokens per image, 4 blocks of width 384"
    )
    return (
        f"The CLI's `extract --images` (embedded `local[*]` Spark; {what}; every block's "
        "output, F16, batch 32; token datasets with the image columns, images.parquet with "
        "thumbnails; `--no-kv-dataset`) against a plain loop over the same files "
        "(`VisionExtractor`: the same model, hook points, batches and outputs). Fresh "
        "processes, timed from start to exit. One run each.\n\n"
        + table(header, rows)
        + "\n\n"
        + table(["", "fixed cost", "per-image slope", "images/s at the slope"], lines)
        + f"\n\nThe slopes' ratio (loop / job): {fits['loop'][1] / fits['job'][1]:.2f}x."
    )


def _large_corpus(path: Path) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pyspark_safetensors.extract import demo_passages

    texts = [t for cut in LARGE_CUTS for _, t in demo_passages(cut)]
    pq.write_table(pa.table({"text": texts}), path)
    return str(path)


def _pair(corpus: str, max_texts: int, tmp: Path, name: str) -> dict:
    """The loop's and the job's runs on one corpus, with equal token counts checked."""
    python = sys.executable
    here = [python, "-m", "benchmarks.bench_extract", "--loop", corpus]
    loop_s, loop_cpu = _timed([*here, str(tmp / f"{name}-loop"), str(max_texts)])
    cli = [python, "-m", "pyspark_safetensors.cli", "extract", "--corpus", corpus,
           "--max-texts", str(max_texts)]  # fmt: skip
    job_s, job_cpu = _timed([*cli, "--out", str(tmp / f"{name}-job")])
    doc = json.loads((tmp / f"{name}-job" / "extraction.json").read_text())["summary"]
    tokens = int((tmp / f"{name}-loop" / "tokens").read_text())
    if tokens != doc["tokens"]:
        raise RuntimeError(f"{name}: the loop stored {tokens} tokens, the job {doc['tokens']}")
    return {"tokens": tokens, "loop_s": loop_s, "loop_cpu": loop_cpu, "job_s": job_s,
            "job_cpu": job_cpu, "model_s": doc["seconds"]}  # fmt: skip


def _fit(tokens: list[int], seconds: list[float]) -> tuple[float, float]:
    """(fixed seconds, seconds per token) of the least-squares line."""
    slope, fixed = np.polyfit(np.asarray(tokens, float), np.asarray(seconds, float), 1)
    return float(fixed), float(slope)


def run() -> str:
    with tempfile.TemporaryDirectory(prefix="bench-extract-") as tmp:
        tmp = Path(tmp)
        corpora = [
            (f"{DEMO_TEXTS} demo passages", "demo", DEMO_TEXTS),
            ("the whole demo corpus", "demo", 0),
            (f"the demo corpus cut {len(LARGE_CUTS)} ways (parquet)",
             _large_corpus(tmp / "large.parquet"), 0),
        ]  # fmt: skip
        runs = {}
        for i, (label, corpus, max_texts) in enumerate(corpora):
            print(f"   {label}", flush=True)
            runs[label] = _pair(corpus, max_texts, tmp, f"c{i}")
        # the KV dataset's cost: the whole demo corpus with and without it, twice each in
        # turn (the faster of each), as one run is within this machine's noise
        with_kv, without_kv = [runs["the whole demo corpus"]["job_s"]], []
        demo_job = [sys.executable, "-m", "pyspark_safetensors.cli", "extract", "--overwrite"]
        for kv in (False, True, False):
            flag = ["--kv-dataset"] if kv else ["--no-kv-dataset"]
            seconds, _ = _timed([*demo_job, *flag, "--out", str(tmp / "kv")])
            (with_kv if kv else without_kv).append(seconds)
    rows = []
    for label, r in runs.items():
        rows.append([
            label, f"{r['tokens']:,}", f"{r['loop_s']:.1f}", f"{r['job_s']:.1f}",
            f"{r['model_s']:.1f}", f"{r['loop_s'] / r['job_s']:.2f}x",
            f"{r['loop_cpu']:.0f} / {r['job_cpu']:.0f}", f"{r['job_cpu'] / r['loop_cpu']:.2f}x",
        ])  # fmt: skip
    tokens = [r["tokens"] for r in runs.values()]
    fits = {who: _fit(tokens, [r[f"{who}_s"] for r in runs.values()]) for who in ("loop", "job")}
    lines = [
        [who, f"{fixed:.1f} s", f"{slope * 1e6:.0f} µs", f"{1 / slope:,.0f}"]
        for who, (fixed, slope) in fits.items()
    ]
    header = ["corpus", "tokens", "loop s", "job s", "job's model stage s",
              "job / loop (tokens/s)", "CPU s loop / job", "CPU per token, job / loop"]  # fmt: skip
    text = (
        "The CLI's `extract` with its defaults (embedded `local[*]` Spark: 2 cores here; "
        "MiniLM-L6, 2 hook points, F16, max_length 128, batch 32; token datasets, KV dataset, "
        "tables) against a plain Python loop over the same texts (one process, all cores: the "
        "same model, windows and batches, F16 token shards written with `safetensors`). Each "
        "a fresh process timed from start to exit; CPU = the machine's busy CPU seconds over "
        "the same span. Equal token counts checked. One run each.\n\n"
        + table(header, rows)
        + "\n\n"
        + table(["", "fixed cost", "per-token slope", "tokens/s at the slope"], lines)
        + f"\n\nThe job's ratio to the loop tends to {fits['loop'][1] / fits['job'][1]:.2f}x "
        "on larger corpora (the slopes' ratio). Its KV dataset, written by default (the "
        f"loop writes none): the whole demo corpus took {min(with_kv):.1f} s with it and "
        f"{min(without_kv):.1f} s with `--no-kv-dataset` (the faster of two runs each)."
    )
    return text + "\n\n" + run_images() + "\n\n" + run_images(SMALL_VIT_COUNTS, "small")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--loop"]:
        loop(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    elif sys.argv[1:2] == ["--image-loop"]:
        image_loop(sys.argv[2], sys.argv[3], sys.argv[4])
    elif sys.argv[1:2] == ["--images"]:  # [--small] [N ...]
        small = sys.argv[2:3] == ["--small"]
        counts = tuple(int(n) for n in sys.argv[2 + small :])
        print(run_images(counts or (SMALL_VIT_COUNTS if small else IMAGE_COUNTS),
                         "small" if small else "toy"))  # fmt: skip
    else:
        print(run())
