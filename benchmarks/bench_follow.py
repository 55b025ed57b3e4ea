"""Training that follows a growing dataset (``python -m benchmarks follow``, by name only).

1. What following costs a reader: ``FollowingBatches`` against ``ShuffledBatches`` over
   the same finished dataset (F16, H = 384, about 400 MB, page cache warm), batches of
   4,096 rows delivered as float32, in GB/s of output.
2. Extraction and training overlapped against one after the other. The producer is the
   extraction's model stage in one plain process (``extract.model.Extractor``, the
   packaged MiniLM, one hook point, demo passages), each chunk of passages appended to the
   dataset as a commit (``DatasetBuilder``), then ``mark_complete``; the consumer is the
   SAE trainer with ``follow = true``. Each stage has half the cores in both arrangements
   (torch threads): one after the other, the producer then the trainer; overlapped, both
   started together. Both train the same steps on the same rows (every row once, to
   ``complete``). Not the Spark extraction: it commits its datasets once, at its end.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import table

BATCH = 4096
HOOK = "encoder.layer.3.output:output"
PASSAGES, PER_COMMIT, MAX_LENGTH = 240, 24, 128
HEADER = ["stages", "extraction s", "training s", "wall s", "after the last commit s", "steps",
          "FVU"]  # fmt: skip


def _read_rates(root: Path) -> list[list[object]]:
    from pyspark_safetensors.dataset import mark_complete, write_batch_dataset
    from pyspark_safetensors.format import to_f16
    from pyspark_safetensors.torch import FollowingBatches, ShuffledBatches, open_dataset

    rows, hidden = 400_000_000 // (2 * 384), 384
    acts = to_f16(np.random.default_rng(0).standard_normal((rows, hidden), dtype=np.float32))
    write_batch_dataset(root, {"activation": acts}, rows_per_shard=65_536)
    mark_complete(root)
    del acts
    loaders = {
        "ShuffledBatches (finished dataset)": lambda: ShuffledBatches(
            open_dataset(root), BATCH, columns=["activation"]
        ),
        "FollowingBatches (the same, followed)": lambda: FollowingBatches(
            root, BATCH, columns=["activation"]
        ),
    }
    out = []
    for name, make in loaders.items():
        for _ in range(2):  # the second pass is the one reported: page cache warm
            start, total = time.perf_counter(), 0
            for batch in make():
                total += batch["activation"].numel() * 4
            seconds = time.perf_counter() - start
        out.append([name, f"{total / seconds / 1e9:.2f}", f"{seconds:.2f}"])
    return out


def produce(root: str, threads: int, ready=None, go=None) -> float:
    """Extract the passages' activations at ``HOOK`` and append each chunk as a commit,
    then mark the dataset complete; returns the seconds it took (the model loaded before;
    with events, ``ready`` is set once it is and the work waits for ``go``)."""
    import torch

    from pyspark_safetensors.dataset import DatasetBuilder, mark_complete
    from pyspark_safetensors.extract.corpus import passages_by_key
    from pyspark_safetensors.extract.model import Extractor, default_model_dir

    torch.set_num_threads(threads)
    extractor = Extractor(default_model_dir(), [HOOK], max_length=MAX_LENGTH, threads=threads)
    texts = passages_by_key(0, PASSAGES)
    if ready is not None:
        ready.set()
        go.wait()
    start = time.perf_counter()
    for first in range(0, len(texts), PER_COMMIT):
        windows = extractor.run(texts[first : first + PER_COMMIT])
        acts = np.concatenate([w.activations[extractor.hooks[0].name] for w in windows])
        with DatasetBuilder(root, batch_size=1 << 16, metadata={"hook_point": HOOK}) as build:
            build.add_batch({"activation": acts})
    mark_complete(root)
    return time.perf_counter() - start


def _produce_in_process(root: str, threads: int, ready, go, result) -> None:
    result.put(produce(root, threads, ready, go))


def train(root: str, out: str, threads: int) -> tuple[float, dict]:
    """Train an SAE following ``root`` to its end; (seconds, last metrics)."""
    import torch

    from pyspark_safetensors.sae import SAEConfig
    from pyspark_safetensors.sae.train import Trainer

    torch.set_num_threads(threads)
    config = SAEConfig(
        dataset=root, n_latents=3072, k=32, batch_size=1024, tokens=1 << 30, follow=True,
        follow_poll_s=0.05, warmup_steps=10, decay_fraction=0.0, out_dir=out,
        progress=False, plots=False, checkpoints=0,
        device="cpu",
    )  # fmt: skip
    start = time.perf_counter()
    metrics = Trainer(config).fit()
    return time.perf_counter() - start, metrics


def _pipelines(tmp: Path) -> list[list[object]]:
    cores = os.cpu_count() or 1
    split = max(1, cores // 2)
    rows = []
    ctx = multiprocessing.get_context("spawn")
    # one after the other, each stage with the threads it has when overlapped
    produced = produce(str(tmp / "seq"), split)
    trained, metrics = train(str(tmp / "seq"), str(tmp / "seq-run"), max(1, cores - split))
    rows.append(["one after the other", f"{produced:.1f}", f"{trained:.1f}",
                 f"{produced + trained:.1f}", f"{trained:.1f}", metrics["step"],
                 f"{metrics['fvu']:.3f}"])  # fmt: skip
    # overlapped: the producer in its own process, the trainer following it here
    result, ready, go = ctx.Queue(), ctx.Event(), ctx.Event()
    args = (str(tmp / "ovl"), split, ready, go, result)
    producer = ctx.Process(target=_produce_in_process, args=args)
    producer.start()
    ready.wait()  # its model loaded, as the sequential producer's was before it was timed
    start = time.perf_counter()
    go.set()
    trained, metrics = train(str(tmp / "ovl"), str(tmp / "ovl-run"), max(1, cores - split))
    producer.join()
    total, produced = time.perf_counter() - start, result.get()
    rows.append(["overlapped (trainer follows)", f"{produced:.1f}", f"{trained:.1f}",
                 f"{total:.1f}", f"{total - produced:.1f}", metrics["step"],
                 f"{metrics['fvu']:.3f}"])  # fmt: skip
    return rows


def run() -> str:
    tmp = Path(tempfile.mkdtemp(prefix="bench-follow-"))
    try:
        reads = _read_rates(tmp / "reads")
        shutil.rmtree(tmp / "reads")
        stages = _pipelines(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    seq, ovl = float(stages[0][3]), float(stages[1][3])
    return "\n\n".join(
        [
            "## Following a growing dataset",
            "Reading a finished dataset (F16, H 384, 400 MB, batches of 4,096 as float32):",
            table(["loader", "GB/s", "s"], reads),
            f"Extraction ({PASSAGES} demo passages through MiniLM, {HOOK}, a commit per "
            f"{PER_COMMIT} passages) and SAE training (3,072 latents, k 32, batch 1,024, "
            "every row once), each stage with half the cores' torch threads:",
            table(HEADER, stages),
            f"Overlapped: {seq / ovl:.2f}x the speed of one after the other, end to end "
            f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores as it ended).",
        ]
    )
