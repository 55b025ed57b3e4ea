"""The code base stays ruff-clean (lint and format), as configured in pyproject.toml."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def ruff() -> str:
    found = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if found is None:
        pytest.fail("ruff is not installed; it is part of the dev extra")
    return found


@pytest.mark.parametrize("args", [["check"], ["format", "--check"]], ids=["check", "format"])
def test_ruff(repo_root, args):
    proc = subprocess.run(
        [ruff(), *args, "--no-cache", "python", "tests", "benchmarks"],
        cwd=repo_root,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
