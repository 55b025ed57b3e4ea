"""What this package reads of Spark's internals, in one place.

Spark's Python data source API does not tell a data source whether filter pushdown is on
(``spark.sql.python.filterPushdown.enabled``), yet Spark >= 4.1 fails a read whose reader
implements ``pushFilters`` while it is off. The planning worker
(``pyspark.sql.worker.plan_data_source_read``) holds the setting in a local variable of
its ``_main`` function while it calls ``DataSource.reader()``; this module reads it from
there. A test runs a real read and fails loudly if Spark renames either.
"""

from __future__ import annotations

import sys

PLANNING_FUNCTION = "_main"
"""The function of Spark's read-planning worker that calls ``DataSource.reader()``."""

PUSHDOWN_FLAG = "enable_pushdown"
"""Its local variable holding ``spark.sql.python.filterPushdown.enabled``."""


def planning_pushdown_flag() -> bool | None:
    """The planning worker's filter-pushdown setting, or None when this call does not run
    inside Spark's read planning (or Spark's internals moved)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == PLANNING_FUNCTION and PUSHDOWN_FLAG in frame.f_locals:
            return bool(frame.f_locals[PUSHDOWN_FLAG])
        frame = frame.f_back
    return None


def pushdown_enabled() -> bool:
    """Whether the reader may push filters: only when Spark's planning worker says the
    setting is on. When the flag cannot be found no filters are pushed (correct, only
    slower)."""
    return planning_pushdown_flag() is True
