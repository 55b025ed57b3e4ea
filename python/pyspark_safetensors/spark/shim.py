"""The JVM shim from Python: where its jar is, the files the package ships beside it, and
how a session loads it (``with_shim``) or tells that it has (``shim_loaded``)."""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

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


def shim_jar() -> Path:
    """The shim jar: ``$PYSPARK_SAFETENSORS_SHIM_JAR``, else the one an installed wheel
    ships, else the one ``jvm-shim/build.sh`` built in a checkout. Raises
    ``FileNotFoundError`` saying how to build it."""
    if os.environ.get(SHIM_JAR_ENV):
        path = Path(os.environ[SHIM_JAR_ENV])
        if not path.is_file():
            raise FileNotFoundError(f"{SHIM_JAR_ENV}={path} is not a file")
        return path
    jars = packaged_files("pyspark-safetensors-shim-*.jar", "jvm-shim/target")
    if not jars:
        raise FileNotFoundError(
            "no shim jar in this installation; build it with jvm-shim/build.sh in a checkout "
            "(offline, needs Java) "
            f"or 'sbt shim/package', or point {SHIM_JAR_ENV} at a jar"
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
