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

JVM_SOURCE = "io.github.pysparksafetensors.SafetensorsSource"
"""The JVM shim's data source class, registered under the short name by its jar."""

SHORT_NAME = "safetensors"


class WorkerPythonError(PysparkSafetensorsError, RuntimeError):
    """Spark's Python workers cannot import pyspark_safetensors."""


class NoSourceError(PysparkSafetensorsError, RuntimeError):
    """Nothing can answer ``format("safetensors")`` in this session: Spark 3.5 has no
    Python data sources, so it needs the shim jar."""


def python_data_sources() -> bool:
    """Whether the installed pyspark has the Python Data Source API (Spark 4.0 and newer)."""
    import importlib.util

    return importlib.util.find_spec("pyspark.sql.datasource") is not None


_HOW_TO_FIX = (
    "Start Spark from the environment that has the package installed (activate it), or set "
    "PYSPARK_PYTHON to that environment's python before the session starts; on a cluster, "
    "install pyspark-safetensors as a cluster or notebook library."
)


def _make_probe(module: str):
    # A nested function is pickled by value, so the worker can run it even when it cannot
    # import this module: that is exactly what it reports.
    def probe(batches):
        import sys

        import pyarrow as pa

        for _ in batches:
            pass
        try:
            import importlib

            importlib.import_module(module)
            error = ""
        except Exception as e:  # reported to the driver, not swallowed
            error = f"{type(e).__name__}: {e}"
        yield pa.RecordBatch.from_pydict({"executable": [sys.executable], "error": [error]})

    return probe


# What the workers import: the Python source's task side where pyspark has Python data
# sources, else the package's Spark layer (the tasks of extract and features import it).
_WORKER_MODULE = "pyspark_safetensors.spark.source"


def _configured_python(spark) -> str:
    """The worker interpreter as the driver sees it (for messages when no worker starts):
    a classic session's context fixed it from ``$PYSPARK_PYTHON`` when it started."""
    context = getattr(spark, "_sc", None)
    return getattr(context, "pythonExec", None) or os.environ.get("PYSPARK_PYTHON", "python3")


def _worker_failure(text: str) -> str:
    """The line of a failed job's error that says why its Python worker failed."""
    patterns = (
        r'Cannot run program "[^"]*": [^\n]*',
        # a daemon module the worker's Python cannot import ("Error while finding module
        # specification for '...' (ModuleNotFoundError: No module named '...')")
        r"ModuleNotFoundError: No module named '[^']*'",
        r"^\s*\w*(?:Error|Exception): [^\n]*",
    )
    for pattern in patterns:
        if found := re.findall(pattern, text, flags=re.M):
            return found[-1].strip()
    return text.strip().splitlines()[0] if text.strip() else ""


def worker_python(spark, module: str = _WORKER_MODULE) -> str:
    """The executable of Spark's Python workers, after checking that they import
    pyspark_safetensors; raises :class:`WorkerPythonError` naming it otherwise."""
    try:
        rows = (
            spark.range(1, numPartitions=1)
            .mapInArrow(_make_probe(module), "executable string, error string")
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
        return bool(manager.dataSourceExists(SHORT_NAME))
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
    return "jvm" if _jvm_source_answers(jvm, session) else "python"


def _jvm_source_answers(jvm, session) -> bool:
    """Whether the short name resolves to the shim jar's JVM source in this classic session."""
    try:
        provider = jvm.org.apache.spark.sql.execution.datasources.DataSource.lookupDataSource(
            SHORT_NAME, session.sessionState().conf()
        )
    except Exception:  # no source of that name at all (Spark 3.5 without the jar)
        return False
    return provider.getName() == JVM_SOURCE


def register(spark, *, check: bool = True) -> str:
    """Register the ``safetensors`` data source in ``spark`` (a classic or Spark Connect
    session) and, unless ``check=False``, make sure Spark's Python workers can import this
    package (one task of one row); raises :class:`WorkerPythonError` saying which Python
    they run otherwise. Returns the implementation that answers ``format("safetensors")``
    (see :func:`implementation`).

    On Spark 3.5, which has no Python data sources, the shim jar's JVM source is the only
    implementation: ``register`` returns ``"jvm"`` when the session has it and raises
    :class:`NoSourceError` saying how to load it otherwise.

    >>> import pyspark_safetensors
    >>> pyspark_safetensors.register(spark)
    'jvm'
    """
    if not python_data_sources():
        return _register_jvm_only(spark, check)
    from .source import SafetensorsDataSource

    if not _statically_registered(spark):
        spark.dataSource.register(SafetensorsDataSource)
    if check:
        worker_python(spark)
    return implementation(spark)


def _register_jvm_only(spark, check: bool) -> str:
    """``register`` where pyspark has no Python data sources: the JVM source must answer."""
    import pyspark

    try:
        answers = _jvm_source_answers(spark._jvm, spark._jsparkSession)
    except Exception:  # Spark Connect: no JVM handle; the server's jar decides
        return "auto"
    if not answers:
        raise NoSourceError(
            f"Spark {pyspark.__version__} has no Python data sources: format('safetensors') "
            "needs the shim jar, loaded when the session starts "
            "(pyspark_safetensors.functions.with_shim(builder), or spark.jars with the jar of "
            "shim_jar(); see the README's support table)"
        )
    if check:
        worker_python(spark, "pyspark_safetensors.spark.columns")
    return "jvm"
