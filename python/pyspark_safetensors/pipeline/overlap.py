"""Extraction and training at once (``[pipeline] overlap = true``).

The extract stage is built in place, under its final name ``extract-{key}`` (a follower
needs a path that does not move), with an ``UNFINISHED`` marker in it from the first
moment: a stage directory holding one is never taken as finished (``Pipeline.stages``),
so a run that crashed halfway is built again on rerun. The extraction commits each
hook point's dataset in ``overlap_groups`` appends, row-aligned across the hook points
(``run_extraction``'s ``commit_groups``), and marks them complete after the last. As soon
as it has counted the token rows to come, the training stages start, their runs following
the datasets (``SAEConfig.follow``) with that count as their budget; they end when every
row has been trained on once. The marker is removed last, once ``extraction.json`` is
written: the stage's commit point.

The two share the machine's cores: the extraction's Python workers take half of them in
torch threads (at least one each; ``extract_threads`` sets it), a training run in the
pipeline's process the rest (torchrun's processes take one thread each, as always); each
stage of a sequential run has all of them.

A finished extraction of the same key is reused, and the runs then follow datasets
already complete (the same training stages, reused too when they exist).
"""

from __future__ import annotations

import os
import shutil
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from ..dataset.publish import staging_path
from .errors import PipelineError

CORES = os.cpu_count() or 1

UNFINISHED = ".unfinished"
"""A stage directory holding this file is being built in place (or its build crashed):
never reused."""


def check_overlap(config) -> None:
    """What an overlapped run needs of its ``PipelineConfig``."""
    if config.epochs != 1:
        raise PipelineError(
            f"overlap trains on each row once, as it lands: set epochs = 1 (got {config.epochs})"
        )
    if config.vision:
        raise PipelineError("overlap takes a text model: the image run's saev dump is written last")
    if not 2 <= config.overlap_groups <= config.texts:
        raise PipelineError(
            f"overlap_groups must be 2..texts ({config.texts}), got {config.overlap_groups}"
        )


def extract_and_train(pipeline) -> tuple[Path, dict]:
    """The extract and train stages of ``pipeline`` (a ``run.Pipeline``) at once; returns
    what ``Pipeline.extract`` and ``Pipeline.train`` return."""
    key = pipeline.extract_key()
    path = pipeline.out / f"extract-{key}"
    if not pipeline.force and path.is_dir() and not (path / UNFINISHED).exists():
        extract_dir = pipeline.extract()  # finished before: reused
        return extract_dir, pipeline.train(extract_dir)
    c = pipeline.config
    pipeline.announce(
        f"extract: {c.texts} passages, {len(c.extracted_hooks)} hook points, in Spark "
        f"({c.master}), in {c.overlap_groups} commits, training from the first one on"
    )
    replaced = _start_in_place(path)
    extraction = _Extraction(pipeline, path / "data")
    tokens = extraction.start()
    pipeline.summary["extraction"] = {"tokens": tokens}
    pipeline.summary["stages"]["extract"] = {"dir": path.name, "hash": key, "reused": False}
    try:
        with _threads(max(1, CORES - CORES // 2)):
            trained = pipeline.train(path / "data")
    except BaseException as error:
        first = extraction.cancel()
        if first is not None:  # the training failed on the data it lost
            raise first from error
        raise
    extraction.wait()
    (path / UNFINISHED).unlink()  # the commit point: extraction.json is in
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)
    pipeline.record("extract", key, reused=False)
    return pipeline.extraction(path), trained


@contextmanager
def _threads(n: int):
    """torch's threads in this process (a training run with ``nproc`` 1) set to ``n``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _start_in_place(path: Path) -> Path | None:
    """``path`` made, holding the marker, in one rename; an unfinished one there is
    deleted, a finished one (``force``) moved aside, returned, to delete once the new one
    is finished."""
    staged = staging_path(path)
    staged.mkdir(parents=True)
    (staged / UNFINISHED).write_text(
        "built in place by an overlapped pipeline run: not finished while this file exists\n"
    )
    replaced = None
    if path.is_dir():
        if (path / UNFINISHED).exists():
            shutil.rmtree(path)
        else:
            replaced = staging_path(path, "replaced")
            os.replace(path, replaced)
    os.replace(staged, path)
    return replaced


class _Extraction:
    """The grouped extraction, run in a thread of its own (the Spark driver's calls wait
    on the JVM, not on the interpreter): ``start`` returns the token rows it will write."""

    def __init__(self, pipeline, out: Path):
        self.pipeline, self.out = pipeline, out
        self.tokens: Future = Future()
        self.session = None
        self.lock = threading.Lock()
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="overlapped-extraction")
        self.done: Future | None = None

    def start(self) -> int:
        self.done = self.pool.submit(self._run)
        self.pool.shutdown(wait=False)
        self.done.add_done_callback(self._failed_early)
        return self.tokens.result()  # the extraction's error when it fails before counting

    def _failed_early(self, done: Future) -> None:
        if not self.tokens.done():
            error = done.exception() or PipelineError("the extraction ended without a count")
            self.tokens.set_exception(error)

    def _run(self) -> None:
        from ..extract import run_extraction
        from ..spark.compat import default_parallelism
        from ..spark.session import local_session

        p = self.pipeline
        c = p.config
        with self.lock:
            self.session = local_session(c.master, quick_jit=True)  # the model runs in Python
        try:
            half = max(1, CORES // 2 // default_parallelism(self.session))
            run_extraction(
                self.session, p.extract_config, self.out, overwrite=True,
                commit_groups=c.overlap_groups, on_tokens=self.tokens.set_result,
                threads=c.extract_threads or half,
            )  # fmt: skip
        finally:
            with self.lock:
                self.session.stop()
                self.session = None

    def cancel(self) -> BaseException | None:
        """Stop the extraction (training failed): its jobs cancelled, what it wrote
        deleted; waits for it. Returns its error if it had failed before."""
        failed = self.done.done() and self.done.exception()
        with self.lock:
            if self.session is not None:
                self.session.sparkContext.cancelAllJobs()
        self.done.exception()  # waited for
        return failed or None

    def wait(self) -> None:
        """Wait for the extraction; its error, if it failed."""
        self.done.result()
