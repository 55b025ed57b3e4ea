"""An embedded local Spark session configured from ``conf/`` (quiet logs, no UI)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

CONF_DIR = Path(__file__).resolve().parents[3] / "conf"


def spark_defaults(path: Path = CONF_DIR / "spark-defaults.conf") -> dict[str, str]:
    """``key value`` pairs of a spark-defaults.conf (empty when the file is absent)."""
    conf = {}
    if path.exists():
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
    from .functions import shim_jar

    try:
        return {"spark.jars": str(shim_jar())}
    except FileNotFoundError:
        return {}


def local_session(master: str = "local[*]", app_name: str = "pyspark-safetensors", **conf: str):
    """A local SparkSession whose Python workers run this interpreter (with the JVM shim's
    jar on the classpath when built; pass ``spark.sql.extensions`` to enable its functions)."""
    from pyspark.sql import SparkSession

    # Workers must import this package: run them with the interpreter we run in.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    builder = SparkSession.builder.master(master).appName(app_name)
    log4j = CONF_DIR / "log4j2.properties"
    if log4j.exists():
        opt = f"-Dlog4j2.configurationFile=file:{log4j}"
        builder = builder.config("spark.driver.extraJavaOptions", opt).config(
            "spark.executor.extraJavaOptions", opt
        )
    for key, value in {**spark_defaults(), **_shim_classpath(), **conf}.items():
        builder = builder.config(key, value)
    return builder.getOrCreate()
