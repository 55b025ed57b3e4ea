"""The JVM shim from Python: where its jar is, the files the package ships beside it, the
Spark install and line it is for (``spark_home``, ``spark_line``), and how a session loads
it (``with_shim``) or tells that it has (``shim_loaded``)."""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

from .._version import __version__
from ..format.errors import PysparkSafetensorsError


class ShimSessionError(PysparkSafetensorsError, RuntimeError):
    """No active session, or a session without the shim where the shim was asked for."""


SHIM_EXTENSIONS = "io.github.pysparksafetensors.SafetensorsExtensions"
"""The ``spark.sql.extensions`` class of the JVM shim."""

SHIM_JAR_ENV = "PYSPARK_SAFETENSORS_SHIM_JAR"
"""An environment variable naming a shim jar to use instead of the packaged one."""

_CHECKOUT = Path(__file__).resolve().parents[3]


def packaged_files(pattern: str, checkout_dir: str) -> list[Path]:
    """Files the package ships, sorted: an installed wheel's copies under
    ``pyspark_safetensors/spark/resources/`` (put there by the build), else those of a source
    checkout or editable install (``checkout_dir`` relative to the repository root)."""
    shipped = resources.files(__package__) / "resources"
    if shipped.is_dir() and (found := sorted(Path(str(shipped)).glob(pattern))):
        return found
    if (_CHECKOUT / "pyproject.toml").is_file():
        return sorted((_CHECKOUT / checkout_dir).glob(pattern))
    return []


def spark_home() -> str:
    """The Spark install a local session runs: ``$SPARK_HOME``, else pip's pyspark."""
    import pyspark

    return os.environ.get("SPARK_HOME") or os.path.dirname(pyspark.__file__)


SPARK_LINES: dict[str, tuple[str, str]] = {
    "3.5": ("3.5.9", "2.12"),
    "4.0": ("4.0.5", "2.13"),
    "4.1": ("4.1.4", "2.13"),
    "4.2": ("4.2.1", "2.13"),
    "4.3": ("4.3.0", "2.13"),
}
"""The supported Spark lines: for each, the pyspark release its jar is built and tested
with, and the Scala version of that line's jars. Adding a line: docs/functions.md."""


class UnsupportedSparkError(PysparkSafetensorsError, RuntimeError):
    """A Spark line that no shim jar is built for."""


def spark_line(version: str | None = None) -> str:
    """The line (``"3.5"``, ``"4.3"``) of Spark ``version`` (default: the installed
    pyspark's), checked against :data:`SPARK_LINES`."""
    if version is None:
        import pyspark

        version = pyspark.__version__
    line = ".".join(version.split(".")[:2])
    if line not in SPARK_LINES:
        raise UnsupportedSparkError(
            f"Spark {version} is not supported: pyspark-safetensors supports Spark "
            f"{', '.join(SPARK_LINES)}"
        )
    return line


def shim_jar_name(line: str) -> str:
    """The file name of the shim jar built for Spark ``line``, named as Spark packages are
    (the line, then the Scala version): ``pyspark-safetensors-shim-3.5_2.12-0.1.0.jar``."""
    return f"pyspark-safetensors-shim-{line}_{SPARK_LINES[line][1]}-{__version__}.jar"


def shim_jar(spark_version: str | None = None) -> Path:
    """The shim jar for the running Spark (``spark_version``, default the installed
    pyspark's): ``$PYSPARK_SAFETENSORS_SHIM_JAR``, else the one an installed wheel ships for
    that line, else the one ``jvm-shim/build.sh`` built in a checkout. Only that line's jar
    is ever returned: a jar of another line breaks a session (Scala 2.13 classes on a 2.12
    Spark fail every data source lookup). Raises ``FileNotFoundError`` saying how to get it."""
    if os.environ.get(SHIM_JAR_ENV):
        path = Path(os.environ[SHIM_JAR_ENV])
        if not path.is_file():
            raise FileNotFoundError(f"{SHIM_JAR_ENV}={path} is not a file")
        return path
    line = spark_line(spark_version)
    name = shim_jar_name(line)
    jars = packaged_files(name, "jvm-shim/target")
    if not jars:
        raise FileNotFoundError(
            f"no shim jar for Spark {line} ({name}) in this installation; build it with "
            f"jvm-shim/build.sh in a checkout whose pyspark is {line} ('./dev test-spark "
            f"{line}' makes one), or point {SHIM_JAR_ENV} at a jar"
        )
    return jars[-1]


def with_shim(builder, *, jars: list[str] = (), extensions: list[str] = ()):
    """``builder`` with the shim jar on ``spark.jars`` and its extension on
    ``spark.sql.extensions`` (plus any other ``jars`` / ``extensions`` you need, since
    both settings are replaced). Call before ``getOrCreate()``."""
    return builder.config("spark.jars", ",".join([str(shim_jar()), *jars])).config(
        "spark.sql.extensions", ",".join([SHIM_EXTENSIONS, *extensions])
    )


def active_session(spark=None):
    """``spark``, else the active session; an error saying to create one when none is."""
    from pyspark.sql import SparkSession

    spark = spark or SparkSession.getActiveSession()
    if spark is None:
        raise ShimSessionError(
            "no active SparkSession: create one before using the tensor functions"
        )
    return spark


def shim_loaded(spark=None) -> bool:
    """Whether the session (default: the active one) has the shim's SQL functions."""
    return active_session(spark).catalog.functionExists("arr_to_st")
