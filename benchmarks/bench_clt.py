"""Cross-layer transcoders (``architecture = "clt"``): the held-out FVU of every layer,
and the training process's peak memory at two token counts (it must not grow with the
tokens: the loader streams the datasets, the threshold calibration reads a fixed number
of rows).

    python -m benchmarks clt
    CLT_TOKENS=65536,262144 CLT_TOY=0 python -m benchmarks clt

A second table trains on a real model's MLPs (``CLT_TOY=0`` leaves it out): the
package's toy Llama (``extract.toy_lm``, 4 layers, hidden 128, trained here once and
cached under the temporary directory), or with ``CLT_MODEL=minilm`` the packaged
all-MiniLM-L6-v2 (6 BERT layers, hidden 384, its MLP read at ``intermediate`` and
written at ``output.dense``), every layer's MLP input and output captured by the
extraction's ``Extractor`` over the demo corpus (the toy model's training passages, at
most ``CLT_MODEL_TOKENS`` tokens, ``CLT_MODEL_EPOCHS`` passes (default 1); its held-out
passages for evaluation), BOS dropped.
The CLT is compared with one transcoder per layer of the same width, k, batches and
tokens (``architecture = "transcoder"``).

The data (``clt_pairs``, made by ``common.clt_layers``, the one generator of the CLT
benchmarks): ``LAYERS`` MLP-like layers of width ``D``. Layer l's input is its own sparse
code (``ACTIVE`` of ``FEATURES`` atoms, log-normal magnitudes of log-sd 0.5) through a
random unit-norm dictionary, plus a large per-layer mean (an MLP's input carries the
residual stream's) and noise; layer t's output is written by the codes of every layer at
or below it (an earlier layer's at half weight), plus noise. Held-out rows are
``VAL_TOKENS`` other draws.

Each token count trains in a fresh process (one pass over a dataset of that many rows),
which samples its own anonymous resident memory (``RssAnon``: what the process
allocated, not the dataset's file pages its memory maps hold) every 20 ms; ``VmHWM``
(peak resident, mapped file pages included) is reported beside it. The data is written
beforehand by the parent process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from .common import clt_layers, table

LAYERS, D, FEATURES, ACTIVE, N_LATENTS, K, BATCH = 4, 64, 256, 4, 512, 8, 1024
VAL_TOKENS = 8192
TOKENS = (65536, 262144)
ROOT = Path(__file__).resolve().parent.parent


def clt_pairs(root: Path, n_tokens: int, seed: int = 0) -> dict[str, list[str]]:
    """Write the inputs and outputs of every layer, training and held-out
    (``common.clt_layers`` at this module's sizes); returns their paths."""
    return clt_layers(root, layers=LAYERS, width=D, atoms=FEATURES, active=ACTIVE,
                      tokens=n_tokens, val_tokens=VAL_TOKENS, sigma=0.5, seed=seed,
                      rows_per_shard=16384)  # fmt: skip


def _anon_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    return 0


def _hwm_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def child(root: str, n_tokens: int) -> dict:
    """One training run in this process on the data ``clt_pairs`` wrote under ``root``
    (``paths.json``): its held-out metrics and peak memory."""
    import torch

    from pyspark_safetensors.sae import SAEConfig
    from pyspark_safetensors.sae.train import Trainer

    torch.set_num_threads(2)
    paths = json.loads((Path(root) / "paths.json").read_text())
    peak, done = [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _anon_kib())
            time.sleep(0.02)

    before = _anon_kib()
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    started = time.perf_counter()
    config = SAEConfig(architecture="clt", datasets=tuple(paths["train_x"]),
                       target_datasets=tuple(paths["train_y"]),
                       val_datasets=tuple(paths["val_x"]),
                       val_target_datasets=tuple(paths["val_y"]), n_latents=N_LATENTS, k=K,
                       batch_size=BATCH, out_dir=str(Path(root) / "run"), checkpoints=2,
                       progress=False, plots=False, val_tokens=VAL_TOKENS)  # fmt: skip
    metrics = Trainer(config).fit()
    seconds = time.perf_counter() - started
    done.set()
    thread.join()
    return {"tokens": n_tokens, "seconds": seconds, "anon_before_mib": before / 1024,
            "peak_anon_mib": peak[0] / 1024, "vm_hwm_mib": _hwm_kib() / 1024,
            "metrics": {k: v for k, v in metrics.items() if k.startswith(("val_", "fvu"))}}  # fmt: skip


def measure(n_tokens: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-clt-") as tmp:
        # written here, not in the measured process: its memory is the training's alone
        (Path(tmp) / "paths.json").write_text(json.dumps(clt_pairs(Path(tmp), n_tokens)))
        code = (f"import json; from benchmarks.bench_clt import child; "
                f"print(json.dumps(child({tmp!r}, {n_tokens})))")  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "2"}
        run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                             capture_output=True, text=True, check=False)  # fmt: skip
        if run.returncode:
            raise SystemExit(f"the CLT run of {n_tokens} tokens failed:\n{run.stderr[-3000:]}")
        return json.loads(run.stdout.strip().splitlines()[-1])


TOY_LATENTS, TOY_K, TOY_BATCH = 1024, 16, 1024
MODELS = {"toy-llama": "The toy Llama (hidden 128, intermediate 384)",
          "minilm": "all-MiniLM-L6-v2 (hidden 384, intermediate 1536)"}  # fmt: skip


def _model_dir(name: str) -> str:
    from pyspark_safetensors.extract.model import resolve_model
    from pyspark_safetensors.extract.toy_lm import toy_lm

    if name == "minilm":
        return resolve_model("").path
    return str(toy_lm(Path(tempfile.gettempdir()) / "bench-clt-models"))


def model_pairs(
    root: Path,
    model: str,
    max_tokens: int,
    *,
    model_dir: str = "",
    texts=None,
    max_length: int = 128,
) -> dict[str, list[str]]:
    """A model's MLP inputs and outputs, every layer, training and held-out texts
    (``texts``: (training, held-out) lists; default the toy model's passages), in
    windows of ``max_length`` tokens; ``model_dir`` overrides ``model``'s directory."""
    from pyspark_safetensors.dataset import write_batch_dataset
    from pyspark_safetensors.extract.model import Extractor
    from pyspark_safetensors.extract.toy_lm import toy_lm_texts

    train, held_out = texts or toy_lm_texts()
    extractor = Extractor(model_dir or _model_dir(model), [], mlp_layers="all", dtype="F32",
                          batch_size=16, max_length=max_length)  # fmt: skip
    names = [h.name for h in extractor.hooks]
    paths: dict[str, list[str]] = {}
    for split, texts, budget in (("train", train, max_tokens), ("val", held_out, max_tokens // 4)):
        rows, n = {name: [] for name in names}, 0
        for start in range(0, len(texts), 64):
            for window in extractor.run(texts[start : start + 64]):
                for name in names:
                    rows[name].append(window.activations[name])
                n += window.seq_len
            if n >= budget:
                break
        for name in names:  # "model.layers.3.mlp:input" -> train_x, layer order kept
            side = "x" if name.endswith(":input") else "y"
            a = np.concatenate(rows[name]).astype(np.float32)
            ids = {"sample_id": np.arange(len(a)) // 128}
            out = root / f"{split}-{name.replace(':', '-')}"
            write_batch_dataset(out, {"activation": a, **ids}, metadata={"hook_point": name})
            paths.setdefault(f"{split}_{side}", []).append(str(out))
    return paths


def model_table() -> str:
    import torch

    from pyspark_safetensors.sae import SAEConfig
    from pyspark_safetensors.sae.train import Trainer
    from pyspark_safetensors.torch import open_dataset

    torch.set_num_threads(2)
    model = os.environ.get("CLT_MODEL", "toy-llama")
    with tempfile.TemporaryDirectory(prefix="bench-clt-model-") as tmp:
        p = model_pairs(Path(tmp), model, int(os.environ.get("CLT_MODEL_TOKENS", 131072)))
        layers = len(p["train_x"])
        epochs = int(os.environ.get("CLT_MODEL_EPOCHS", 1))
        rows = len(open_dataset(p["train_x"][0]))
        common = dict(n_latents=TOY_LATENTS, k=TOY_K, batch_size=TOY_BATCH, checkpoints=0,
                      tokens=epochs * rows,
                      progress=False, plots=False, val_tokens=0)  # fmt: skip
        started = time.perf_counter()
        clt = Trainer(SAEConfig(architecture="clt", datasets=tuple(p["train_x"]),
                                target_datasets=tuple(p["train_y"]),
                                val_datasets=tuple(p["val_x"]),
                                val_target_datasets=tuple(p["val_y"]),
                                out_dir=f"{tmp}/clt", **common)).fit()  # fmt: skip
        clt_seconds = time.perf_counter() - started
        rows = [["CLT", *(f"{clt[f'val_fvu_layer{t}']:.3f}" for t in range(layers)),
                 f"{clt['val_l0'] / layers:.1f}", f"{clt_seconds:.0f}"]]  # fmt: skip
        single, seconds = [], 0.0
        for t in range(layers):
            started = time.perf_counter()
            m = Trainer(SAEConfig(architecture="transcoder", dataset=p["train_x"][t],
                                  target_dataset=p["train_y"][t], val_dataset=p["val_x"][t],
                                  val_target_dataset=p["val_y"][t], out_dir=f"{tmp}/t{t}",
                                  **common)).fit()  # fmt: skip
            seconds += time.perf_counter() - started
            single.append(m)
        rows.append(["a transcoder per layer", *(f"{m['val_fvu']:.3f}" for m in single),
                     f"{np.mean([m['val_l0'] for m in single]):.1f}", f"{seconds:.0f}"])  # fmt: skip
        tokens = clt["tokens"]
    header = ["", *(f"held-out FVU, layer {t}" for t in range(layers)), "L0 per layer",
              "seconds (2 cores)"]  # fmt: skip
    return (
        f"{MODELS[model]}'s {layers} MLPs, {tokens:,} training "
        f"tokens ({epochs} pass{'es' * (epochs > 1)}), {TOY_LATENTS} latents and k = {TOY_K} per layer, batch "
        f"{TOY_BATCH}, defaults otherwise; held-out: the model's held-out passages.\n\n"
        + table(header, rows)
    )


def _per_layer(metrics: dict, key: str) -> str:
    return " / ".join(f"{metrics[f'{key}_layer{t}']:.3f}" for t in range(LAYERS))


def run() -> str:
    raw = os.environ.get("CLT_TOKENS", "")
    counts = [int(t) for t in raw.split(",") if t.strip()] or list(TOKENS)
    results = [measure(n) for n in counts]
    toy = model_table() if os.environ.get("CLT_TOY", "1") != "0" else ""
    header = ["training tokens", "steps", "held-out FVU per layer", "L0 per layer",
              "dead per layer", "peak RssAnon MiB", "VmHWM MiB", "seconds"]  # fmt: skip
    rows = []
    for r in results:
        per = [_per_layer(r["metrics"], key) for key in ("val_fvu", "val_l0", "val_dead_fraction")]
        rows.append([f"{r['tokens']:,}", r["tokens"] // BATCH, *per, f"{r['peak_anon_mib']:.0f}",
                     f"{r['vm_hwm_mib']:.0f}", f"{r['seconds']:.0f}"])  # fmt: skip
    return (
        f"## Cross-layer transcoders\n\n{LAYERS} MLP-like layers of width {D} "
        f"(`benchmarks/bench_clt.py`: each layer's output written by the sparse codes of "
        f"every layer at or below it), {N_LATENTS} latents and k = {K} per layer, TopK, "
        f"batch {BATCH}, one pass over the training tokens, default learning rate and "
        f"schedule; held-out figures on {VAL_TOKENS:,} other tokens, layers 0 to "
        f"{LAYERS - 1}. Peak RssAnon: the training process's own memory (sampled every "
        f"20 ms, torch's imports included); VmHWM adds the "
        f"dataset pages its memory maps hold.\n\n"
        + table(header, rows)
        + (f"\n\n{toy}" if toy else "")
    )
