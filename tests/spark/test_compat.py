"""What the package reads of Spark's internals (``spark/compat.py``) is still there: these
tests fail loudly when a Spark upgrade moves it."""

from __future__ import annotations

import inspect

import pytest

pytest.importorskip("pyspark.sql.datasource", reason="this Spark has no Python data sources")

import pyspark.sql.datasource
from pyspark.sql.datasource import DataSource, DataSourceReader

from pyspark_safetensors.spark import compat

pytestmark = [
    pytest.mark.spark,
    pytest.mark.skipif(
        not hasattr(pyspark.sql.datasource, "EqualTo"),
        reason="this Spark has no filter pushdown for Python data sources (4.1+)",
    ),
]


def flag_probe():
    """A data source reading one row: what ``planning_pushdown_flag()`` saw while
    ``reader()`` ran (made in a function, so Spark's workers get it by value)."""

    class FlagProbe(DataSource):
        @classmethod
        def name(cls):
            return "pushdown_flag_probe"

        def schema(self):
            return "flag string"

        def reader(self, schema):
            seen = str(compat.planning_pushdown_flag())

            class Reader(DataSourceReader):
                def read(self, partition):
                    yield (seen,)

            return Reader()

    return FlagProbe


def test_the_planning_worker_still_holds_the_flag_where_compat_looks():
    from pyspark.sql.worker import plan_data_source_read

    planning = getattr(plan_data_source_read, compat.PLANNING_FUNCTION, None)
    assert planning is not None, (
        f"Spark's read-planning worker has no {compat.PLANNING_FUNCTION}(): update spark/compat.py"
    )
    assert compat.PUSHDOWN_FLAG in planning.__code__.co_varnames, (
        f"{compat.PLANNING_FUNCTION}() has no local {compat.PUSHDOWN_FLAG!r}: update spark/compat.py"
    )
    assert "reader(" in inspect.getsource(planning)


def test_a_real_read_sees_the_setting(spark):
    spark.dataSource.register(flag_probe())
    seen = {}
    for enabled in ("true", "false"):
        spark.conf.set("spark.sql.python.filterPushdown.enabled", enabled)
        try:
            seen[enabled] = spark.read.format("pushdown_flag_probe").load().first().flag
        finally:
            spark.conf.unset("spark.sql.python.filterPushdown.enabled")
    assert seen == {"true": "True", "false": "False"}, (
        f"spark/compat.py no longer finds Spark's filter-pushdown setting: {seen}"
    )
    assert compat.planning_pushdown_flag() is None  # outside Spark's planning: not found
