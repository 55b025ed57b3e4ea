"""The two implementations of ``format("safetensors")`` for the tests that run against
both: the Python source, and the JVM source of the shim jar. Each read or write names its
implementation with the ``implementation`` option, so one session serves both."""

from __future__ import annotations

import pytest

IMPLEMENTATIONS = ("python", "jvm")
JVM_SOURCE = "io.github.pysparksafetensors.SafetensorsSource"


def jvm_available(spark) -> bool:
    """Whether the session's classpath has the JVM source (the shim jar, built)."""
    try:
        spark._jvm.org.apache.spark.util.Utils.classForName(JVM_SOURCE, True, False)
        return True
    except Exception:  # py4j wraps the ClassNotFoundException
        return False


def require(spark, implementation: str) -> str:
    """``implementation``, after skipping the test when it is the JVM one and the session
    lacks the jar."""
    if implementation == "jvm" and not jvm_available(spark):
        pytest.skip("no JVM source on the class path (build it with jvm-shim/build.sh)")
    return implementation


def reader(spark, implementation: str):
    """``spark.read.format("safetensors")`` answered by ``implementation``."""
    return spark.read.format("safetensors").option("implementation", implementation)


def writer(df, implementation: str):
    """``df.write.format("safetensors")`` answered by ``implementation``."""
    return df.write.format("safetensors").option("implementation", implementation)
