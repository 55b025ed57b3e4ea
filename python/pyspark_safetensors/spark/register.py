"""Explicit registration of the ``safetensors`` data source, checked against the Python
that Spark's workers actually run.

Spark finds ``pyspark_*`` data sources on its own at session start, but it does so in a
Python process started from ``$PYSPARK_PYTHON`` (default ``python3`` on ``PATH``), and a
failed lookup is silent: the first ``format("safetensors")`` then fails with
``DATA_SOURCE_NOT_FOUND``. :func:`register` makes the source known whatever that lookup
found and proves, with one tiny job, that the workers can import this package — or says
which Python they run and how to fix it.
"""

from __future__ import annotations

import os
import re

from ..format.errors import PysparkSafetensorsError
from .options import IMPLEMENTATION_CONF
from .source import SafetensorsDataSource

JVM_SOURCE = "io.github.pysparksafetensors.SafetensorsSource"
"""The JVM shim's data source class, registered under the short name by its jar."""


class WorkerPythonError(PysparkSafetensorsError, RuntimeError):
    """Spark's Python workers cannot import pyspark_safetensors."""


_HOW_TO_FIX = (
    "Start Spark from the environment that has the package installed (activate it), or set "
    "PYSPARK_PYTHON to that environment's python before the session starts; on a cluster, "
    "install pyspark-safetensors as a cluster or notebook library."
)


def _make_probe():
    # A nested function is pickled by value, so the worker can run it even when it cannot
    # import this module: that is exactly what it reports.
    def probe(batches):
        import sys

        import pyarrow as pa

        for _ in batches:
            pass
        try:
            import pyspark_safetensors.spark.source  # noqa: F401  what the source's tasks import

            error = ""
        except Exception as e:  # reported to the driver, not swallowed
            error = f"{type(e).__name__}: {e}"
        yield pa.RecordBatch.from_pydict({"executable": [sys.executable], "error": [error]})

    return probe


def _configured_python(spark) -> str:
    """The worker interpreter as the driver sees it (for messages when no worker starts):
    a classic session's context fixed it from ``$PYSPARK_PYTHON`` when it started."""
    context = getattr(spark, "_sc", None)
    return getattr(context, "pythonExec", None) or os.environ.get("PYSPARK_PYTHON", "python3")


def _worker_failure(text: str) -> str:
    """The line of a failed job's error that says why its Python worker failed."""
    for pattern in (r'Cannot run program "[^"]*": [^\n]*', r"^\s*\w*(?:Error|Exception): [^\n]*"):
        if found := re.findall(pattern, text, flags=re.M):
            return found[-1].strip()
    return text.strip().splitlines()[0] if text.strip() else ""


def worker_python(spark) -> str:
    """The executable of Spark's Python workers, after checking that they import
    pyspark_safetensors; raises :class:`WorkerPythonError` naming it otherwise."""
    try:
        rows = (
            spark.range(1, numPartitions=1)
            .mapInArrow(_make_probe(), "executable string, error string")
            .collect()
        )
    except Exception as e:
        reason = _worker_failure(str(e)) or type(e).__name__
        raise WorkerPythonError(
            f"Spark's workers run {_configured_python(spark)}, which cannot import "
            f"pyspark_safetensors: its Python worker failed ({reason}). {_HOW_TO_FIX}"
        ) from e
    executable, error = rows[0]["executable"], rows[0]["error"]
    if error:
        raise WorkerPythonError(
            f"Spark's workers run {executable}, which cannot import pyspark_safetensors: "
            f"{error}. {_HOW_TO_FIX}"
        )
    return executable


def _statically_registered(spark) -> bool:
    """Whether Spark's own lookup already found the source (re-registering it would log a
    warning). Only classic sessions can tell; elsewhere it is registered again."""
    try:
        manager = spark._jsparkSession.sessionState().dataSourceManager()
        return bool(manager.dataSourceExists(SafetensorsDataSource.name()))
    except Exception:  # Spark Connect: no JVM handle
        return False


def implementation(spark) -> str:
    """Which implementation answers ``format("safetensors")`` in ``spark``: ``"jvm"`` where
    the shim jar is on the classpath (its source takes the short name) and the conf
    ``spark.pyspark_safetensors.implementation`` does not say ``python``, else
    ``"python"``. A Spark Connect client cannot see the server's classpath: it answers
    ``"python"`` when the conf says so and ``"auto"`` (the server's jar decides) otherwise.
    The option ``implementation`` overrides this for one read or write."""
    chosen = (spark.conf.get(IMPLEMENTATION_CONF, None) or "auto").strip().lower()
    if chosen == "python":
        return "python"
    try:
        jvm, session = spark._jvm, spark._jsparkSession
    except Exception:  # Spark Connect: no JVM handle
        return "auto"
    provider = jvm.org.apache.spark.sql.execution.datasources.DataSource.lookupDataSource(
        SafetensorsDataSource.name(), session.sessionState().conf()
    )
    return "jvm" if provider.getName() == JVM_SOURCE else "python"


def register(spark, *, check: bool = True) -> str:
    """Register the ``safetensors`` data source in ``spark`` (a classic or Spark Connect
    session) and, unless ``check=False``, make sure Spark's Python workers can import this
    package (one task of one row); raises :class:`WorkerPythonError` saying which Python
    they run otherwise. Returns the implementation that answers ``format("safetensors")``
    (see :func:`implementation`).

    >>> import pyspark_safetensors
    >>> pyspark_safetensors.register(spark)
    'jvm'
    """
    if not _statically_registered(spark):
        spark.dataSource.register(SafetensorsDataSource)
    if check:
        worker_python(spark)
    return implementation(spark)
