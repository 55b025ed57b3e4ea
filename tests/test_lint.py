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


def test_python_files_under_tests_have_unique_names(repo_root):
    # pytest imports test modules and helpers by basename (no packages under tests/): two
    # files of one name make the second fail to collect, or import the wrong helper.
    seen: dict[str, Path] = {}
    clashes = []
    for path in sorted((repo_root / "tests").rglob("*.py")):
        if path.name == "conftest.py":
            continue  # pytest loads each conftest by path
        if path.name in seen:
            clashes.append(
                f"{seen[path.name].relative_to(repo_root)} and {path.relative_to(repo_root)}"
            )
        seen.setdefault(path.name, path)
    assert not clashes, "rename one of each pair: " + "; ".join(clashes)
