"""Spark's Python daemon with the modules of this package's tasks imported once, before it
forks a worker for each task.

Spark runs one daemon per executor (``python -m pyspark.daemon``) and forks it for every
new Python worker. Its own daemon imports nothing before the fork, so each worker imports
pandas, pyarrow, numpy and this package's data source again: about 0.25 s of CPU per
worker, which is most of what a short task costs (2 cores, Python 3.11: 220 writer and
reader tasks, each in a fresh worker, took 116 s of CPU with Spark's daemon, 64 s with
this one). Set it with ``spark.python.daemon.module=pyspark_safetensors.spark.daemon``;
:func:`~pyspark_safetensors.spark.session.local_session` does (``conf/spark-defaults.conf``).

After the imports the daemon freezes the garbage collector's view of every object it
holds (``gc.freeze``): Spark's daemon runs ``gc.collect()`` in each worker after every
task, and a full collection walks every tracked object — about 80,000 once pandas,
pyarrow and this package are imported, 0.04-0.1 s of CPU per task, more than a small
task's own work (a Python source yielding 1,000,000 x 256 float32 rows in 32 tasks: its
workers' CPU 1.86 s, 0.38 s frozen). Frozen objects are never collected; they are the
modules' own, which live as long as the process anyway, and their pages stay shared
with the daemon (a collection writes to every object it walks).

Spark's daemon waits because an arbitrary module may start threads at import, and a
thread's locks do not survive a fork. These modules start no Python thread; the native
ones they start (OpenBLAS's pool, jemalloc's background thread) have fork handlers that
leave the child in a clean state, as PyTorch's ``DataLoader`` workers, forked from
processes that hold them, rely on. torch and transformers, which the extraction's
workers load, are left to the workers: a session that never runs a model should not pay
for them. Spark's planner processes (a data source's schema, partitions, write and
commit) always start from ``pyspark.daemon``; only task workers come from this one.
"""

import gc
import importlib

from pyspark import daemon

PRELOADED = (
    "numpy",
    "pyarrow",
    "pandas",
    "crc32c",
    "pyspark_safetensors.spark.source",
    "pyspark.worker",
    "pyspark.sql.worker.plan_data_source_read",
)
"""Imported before the fork: the libraries, the data source, and the modules a task worker
runs (``pyspark.worker``) and a Python data source's read function lives in."""


def preload(names=PRELOADED) -> list[str]:
    """Import ``names``; returns those that failed. A module that cannot be imported here
    (no pandas, Spark 3.5's missing data source API) is left to the workers that need it,
    which report its error as without this daemon."""
    failed = []
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:
            failed.append(name)
    return failed


if __name__ == "__main__":
    preload()
    gc.freeze()
    daemon.manager()
