"""The set-up entry point stops with a clear message when Java is missing or too old."""

import os
import subprocess

import pytest


@pytest.mark.parametrize("version,expect", [("11.0.2", "Java 11 found"), (None, "was not found")])
def test_dev_refuses_missing_or_old_java(repo_root, tmp_path, version, expect):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "sed", "head", "dirname", "cat", "sha256sum", "cut"):
        path = subprocess.run(
            ["bash", "-c", f"command -v {tool}"], capture_output=True, text=True
        ).stdout.strip()
        if path:
            (bin_dir / tool).symlink_to(path)
    if version is not None:
        fake = bin_dir / "java"
        fake.write_text(f"#!/bin/sh\necho 'openjdk version \"{version}\" 2019-01-15' >&2\n")
        fake.chmod(0o755)
    proc = subprocess.run(
        ["bash", str(repo_root / "dev"), "setup"],
        env={**{k: v for k, v in os.environ.items() if k != "JAVA_HOME"}, "PATH": str(bin_dir)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert expect in proc.stderr and "17" in proc.stderr
