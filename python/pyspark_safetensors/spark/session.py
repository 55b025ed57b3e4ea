"""An embedded local Spark session configured from ``conf/`` (quiet logs, no UI)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from .class_archive import with_archive
from .shim import packaged_files, shim_jar

CONF_DIR_ENV = "PYSPARK_SAFETENSORS_CONF_DIR"
"""A directory whose ``spark-defaults.conf`` / ``log4j2.properties`` replace the shipped ones."""


def conf_file(name: str) -> Path | None:
    """``$PYSPARK_SAFETENSORS_CONF_DIR/name`` when set, else the shipped ``conf/name``."""
    if os.environ.get(CONF_DIR_ENV):
        path = Path(os.environ[CONF_DIR_ENV]) / name
        return path if path.is_file() else None
    return next(iter(packaged_files(name, "conf")), None)


def spark_defaults(path: Path | None = None) -> dict[str, str]:
    """``key value`` pairs of a spark-defaults.conf (default: :func:`conf_file`'s; empty
    when there is none)."""
    path = path or conf_file("spark-defaults.conf")
    conf = {}
    if path is not None and path.exists():
        for line in path.read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                key, _, value = line.partition(" ")
                conf[key] = value.strip()
    return conf


def _shim_classpath() -> dict[str, str]:
    """The JVM shim jar on ``spark.jars`` when it is built. The driver's classpath is fixed
    when the process's first session starts the JVM, so every session carries the jar and a
    later one can enable the extension (``spark.sql.extensions``); the jar alone registers
    nothing."""
    try:
        return {"spark.jars": str(shim_jar())}
    except FileNotFoundError:
        return {}


CHECKPOINT_MANAGER = "spark.sql.streaming.checkpointFileManagerClass"


def checkpoint_manager(version: str) -> dict[str, str]:
    """A streaming query's checkpoint logs written through Hadoop's ``FileSystem`` API
    (Spark's ``FileSystemBasedCheckpointFileManager``: a temporary file, then a rename,
    atomic on a local disk), on the Spark lines whose class name is known. Spark's default,
    the ``FileContext`` API, creates each log file and directory with an explicit
    permission, which a JVM without Hadoop's native library (pyspark's wheels have none)
    sets by forking ``chmod``: 30-40 ms on each of the offset, commit and source logs of
    every micro-batch, 0.13 s a trigger against 0.04 s."""
    major, minor = (int(part) for part in version.split(".")[:2])
    if (major, minor) < (3, 5):
        return {}
    package = "org.apache.spark.sql.execution.streaming"
    if (major, minor) >= (4, 1):  # moved with the checkpoint code in Spark 4.1
        package += ".checkpointing"
    return {CHECKPOINT_MANAGER: f"{package}.FileSystemBasedCheckpointFileManager"}


QUICK_JIT = "-XX:TieredStopAtLevel=1"
"""The Java option of a driver whose own work is light, as in the extraction, where the
Python workers run the model and the JVM only hands them texts and takes back small rows:
the JIT compiles with its first tier only, and the cores its second tier would have taken
go to the model (the whole demo corpus: 28.4 s instead of 30.8 s on 2 cores). Jobs whose
work is in the JVM (writes of the JVM source, large aggregations) keep the default."""


def local_session(
    master: str = "local[*]",
    app_name: str = "pyspark-safetensors",
    *,
    quick_jit: bool = False,
    **conf: str,
):
    """A local SparkSession whose Python workers run this interpreter (with the JVM shim's
    jar on the classpath when built; pass ``spark.sql.extensions`` to enable its functions),
    its driver (and a ``local-cluster`` master's executors) mapping the class archive when
    one is built (``class_archive``: they start in about half the time). ``quick_jit``:
    the driver's JIT stops at its first tier (``QUICK_JIT``). Java options given in
    ``conf`` come after the archive's and the shipped logging configuration's."""
    from pyspark.sql import SparkSession

    # Workers must import this package: run them with the interpreter we run in.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    builder = SparkSession.builder.master(master).appName(app_name)
    for key, value in session_settings(conf, quick_jit=quick_jit).items():
        builder = builder.config(key, value)
    return builder.getOrCreate()


def session_settings(conf: dict[str, str], *, quick_jit: bool = False) -> dict[str, str]:
    """What ``local_session`` configures: the checkpoint manager (``checkpoint_manager``),
    the shipped defaults, the shim jar, then ``conf``; the driver's and executors' Java
    options led by the logging configuration, the class archive's and (driver,
    ``quick_jit``) ``QUICK_JIT``, so that options given in ``conf`` win."""
    import pyspark

    settings = {
        **checkpoint_manager(pyspark.__version__),
        **spark_defaults(),
        **_shim_classpath(),
        **conf,
    }
    log4j = conf_file("log4j2.properties")
    for key in ("spark.driver.extraJavaOptions", "spark.executor.extraJavaOptions"):
        options = settings.get(key, "")
        if quick_jit and key == "spark.driver.extraJavaOptions":
            options = f"{QUICK_JIT} {options}".strip()
        if log4j is not None:
            options = f"-Dlog4j2.configurationFile=file:{log4j} {options}".strip()
        options = with_archive(options)
        if options:
            settings[key] = options
    return settings
