"""Shared fixtures. Tiers are pytest markers (see pyproject): unit, spark, distributed,
integration, jvm. Spark sessions are made per module by the ``spark`` fixture."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


def pytest_collection_modifyitems(config, items):
    # Tests with no tier marker are unit tests.
    tiers = {"spark", "distributed", "integration", "jvm"}
    for item in items:
        if not any(m.name in tiers for m in item.iter_markers()):
            item.add_marker(pytest.mark.unit)


os.environ.setdefault("PYARROW_IGNORE_TIMEZONE", "1")


@pytest.fixture(scope="module")
def spark():
    """One local Spark session per test module (local[2]; task retries for retry tests)."""
    from pyspark_safetensors.spark.session import local_session

    session = local_session(
        "local[2, 4]",
        app_name="pyspark-safetensors-tests",
        **{"spark.ui.showConsoleProgress": "false"},
    )
    yield session
    session.stop()
