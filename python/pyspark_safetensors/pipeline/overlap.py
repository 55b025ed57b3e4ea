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

The extraction is the critical path: its Python workers take every core in torch threads,
as in a sequential run (``extract_threads`` sets them). The training runs in a thread of
its own with a torch thread for each core the extraction leaves. Where it leaves none, the
training has the pipeline's torch threads at the lowest CPU priority (Linux: a nice value
of 19, which torchrun's processes inherit): it trains in the extraction's gaps, and on
every core once the extraction is done. (Never more threads than free cores beside the
extraction at the same priority: an OpenMP team sharing a core runs at the pace of its
slowest thread.) Split evenly instead, each stage ran at half speed and the whole was
slower than one stage after the other (``docs/BENCHMARKS.md``). An extraction that fails
ends the run at once, with its own error (also when the training failed first on the
data the failed extraction deleted under it): the stage's directory is deleted, and the
training's thread, a daemon, is not waited for.

A finished extraction of the same key is reused, and the runs then follow datasets
already complete (the same training stages, reused too when they exist).
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from pathlib import Path

from ..dataset.errors import DatasetReplacedError
from ..dataset.publish import staging_path
from .errors import PipelineError

CORES = os.cpu_count() or 1

UNFINISHED = ".unfinished"
"""A stage directory holding this file is being built in place (or its build crashed):
never reused."""


FAILURE_GRACE_SECONDS = 10.0
"""How long a run whose training failed first waits for the extraction to fail on its own
(its error, the cause, is then the run's) before cancelling it."""


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
    free = CORES - extraction.cores
    training = (
        _in_background(pipeline.train, path / "data", threads=free)
        if free > 0
        else _in_background(pipeline.train, path / "data", lowest_priority=True)
    )
    try:
        wait([extraction.done, training], return_when=FIRST_EXCEPTION)
        if training.done():
            training.result()  # its error, if it failed first
        extraction.wait()
        trained = training.result()
    except BaseException as error:
        if training.done() and not extraction.done.done():
            # the training failed first, maybe on data a failing extraction deletes under
            # it: a moment for the extraction's own error to show before it is cancelled
            wait([extraction.done], timeout=FAILURE_GRACE_SECONDS)
        own = extraction.done.exception() if extraction.done.done() else None
        first = extraction.cancel()
        if not training.done() or own is not None:  # the followers' data vanishes: they stop
            shutil.rmtree(path, ignore_errors=True)
        # a failed extraction deletes what the training followed: the training may fail on
        # that first (a shard gone under its manifest), but the extraction's error is the cause
        cause = own is not None or isinstance(error, DatasetReplacedError)
        if first is not None and first is not error and cause:
            raise first from error
        raise
    (path / UNFINISHED).unlink()  # the commit point: extraction.json is in
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)
    pipeline.record("extract", key, reused=False)
    return pipeline.extraction(path), trained


def _in_background(fn, *args, threads: int | None = None, lowest_priority: bool = False) -> Future:
    """``fn(*args)`` in a daemon thread (an interrupted run does not wait for it), with
    ``threads`` torch threads (default: this thread's; OpenMP keeps a count per thread),
    at the lowest CPU priority if asked, where threads have their own (Linux)."""
    import torch

    before, result = torch.get_num_threads(), Future()

    def body() -> None:
        if lowest_priority and sys.platform.startswith("linux"):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        torch.set_num_threads(threads or before)
        try:
            value = fn(*args)
        except BaseException as error:
            torch.set_num_threads(before)
            result.set_exception(error)
        else:  # restored first: torch keeps the count for the threads started later
            torch.set_num_threads(before)
            result.set_result(value)

    threading.Thread(target=body, name="overlapped-training", daemon=True).start()
    return result


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
        self.cores = 0
        """The cores its workers take in torch threads (known once ``start`` returns)."""

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
        from ..extract.job import worker_threads
        from ..spark.compat import default_parallelism
        from ..spark.session import local_session

        p = self.pipeline
        c = p.config
        with self.lock:
            self.session = local_session(c.master, quick_jit=True)  # the model runs in Python
        try:
            parallelism = default_parallelism(self.session)
            threads = worker_threads(parallelism, c.extract_threads)
            self.cores = threads * parallelism
            run_extraction(
                self.session, p.extract_config, self.out, overwrite=True,
                commit_groups=c.overlap_groups, on_tokens=self.tokens.set_result,
                threads=threads,
            )  # fmt: skip
        finally:
            with self.lock:
                self.session.stop()
                self.session = None

    def cancel(self) -> BaseException | None:
        """Stop the extraction (the training failed, or the run was interrupted): its jobs
        cancelled, what it wrote deleted; waits for it. Returns its error, if any."""
        with self.lock:
            if self.session is not None:
                self.session.sparkContext.cancelAllJobs()
        return self.done.exception()  # waited for

    def wait(self) -> None:
        """Wait for the extraction; its error, if it failed."""
        self.done.result()
