"""The Spark lines: one table (``SPARK_LINES``) that build.sbt repeats, one jar per line, and
the running line's jar the only one a session is given."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pyspark_safetensors._version import __version__
from pyspark_safetensors.spark.shim import (
    SHIM_JAR_ENV,
    SPARK_LINES,
    UnsupportedSparkError,
    shim_jar,
    shim_jar_name,
    spark_line,
)

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def test_build_sbt_has_the_same_matrix_and_version():
    sbt = (REPO / "build.sbt").read_text()
    rows = re.findall(r'\("(\d+\.\d+)", "([\d.]+)", "(2\.1[23])\.\d+"\)', sbt)
    assert {line: (release, scala) for line, release, scala in rows} == SPARK_LINES
    assert re.search(r'ThisBuild / version := "(.*)"', sbt).group(1) == __version__
    for line in SPARK_LINES:
        assert f'shim("{line}")' in sbt


def test_jar_names_carry_the_line_and_its_scala_version():
    assert shim_jar_name("3.5") == f"pyspark-safetensors-shim-3.5_2.12-{__version__}.jar"
    assert shim_jar_name("4.3") == f"pyspark-safetensors-shim-4.3_2.13-{__version__}.jar"
    assert spark_line("4.0.5") == "4.0" and spark_line("3.5.9") == "3.5"


def test_a_line_outside_the_table_is_one_line_naming_the_supported_ones(monkeypatch):
    monkeypatch.delenv(SHIM_JAR_ENV, raising=False)
    for version in ("3.4.1", "5.0.0"):
        with pytest.raises(UnsupportedSparkError) as e:
            shim_jar(version)
        message = str(e.value)
        assert "\n" not in message and f"Spark {version} is not supported" in message
        assert all(line in message for line in SPARK_LINES)


def test_only_the_running_lines_jar_is_taken(monkeypatch, tmp_path):
    monkeypatch.delenv(SHIM_JAR_ENV, raising=False)
    built = {p.name for p in (REPO / "jvm-shim" / "target").glob("*.jar")}
    for line in SPARK_LINES:
        if shim_jar_name(line) in built:
            assert shim_jar(SPARK_LINES[line][0]).name == shim_jar_name(line)
        else:  # a missing jar is one line saying how to build it, never another line's jar
            with pytest.raises(FileNotFoundError, match=f"no shim jar for Spark {line}.*build"):
                shim_jar(SPARK_LINES[line][0])


def test_every_line_folder_is_small_and_nothing_is_copied():
    src = REPO / "jvm-shim" / "src"
    common = {p.name for p in (src / "main" / "scala").rglob("*.scala")}
    folders = sorted(p for p in src.iterdir() if p.name.startswith("spark-"))
    assert folders, "no per-line folder"
    for folder in folders:
        files = list(folder.rglob("*.scala"))
        assert files and sum(len(f.read_text().splitlines()) for f in files) < 60, folder
        assert not {f.name for f in files} & common, f"{folder.name} copies a common file"
