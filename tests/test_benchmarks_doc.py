"""``./dev bench`` rewrites its own blocks of docs/BENCHMARKS.md in place and leaves the
rest of the page as it is; another Spark line's block says which line it measured."""

import pytest

import benchmarks.__main__ as bench
from pyspark_safetensors.spark import shim

pytestmark = pytest.mark.unit

SECTION = "## Spark writer: 200,000 rows\n\n| a |\n|---|\n| {} |"


def on_line(monkeypatch, line, body):
    monkeypatch.setattr(shim, "spark_line", lambda: line)
    return bench.block_for_this_line("writer", body)


def test_a_block_is_replaced_in_place_and_another_lines_heading_names_it(tmp_path, monkeypatch):
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text("# Benchmarks\n\n## Findings\n\nwritten by hand\n")
    monkeypatch.setattr(bench, "DOC", doc)
    newest = list(shim.SPARK_LINES)[-1]
    bench.update(*on_line(monkeypatch, newest, SECTION.format(1)))
    bench.update(*on_line(monkeypatch, "3.5", SECTION.format(2)))
    bench.update(*on_line(monkeypatch, newest, SECTION.format(3)))  # the newest's, again
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\n## Findings\n\nwritten by hand\n")
    assert text.count("<!-- bench:writer -->") == 1 and "| 1 |" not in text
    newest_block, line_block = text.split("<!-- bench:writer@spark-3.5 -->")
    assert "## Spark writer: 200,000 rows\n" in newest_block and "| 3 |" in newest_block
    assert "## Spark writer: 200,000 rows (Spark 3.5)\n" in line_block and "| 2 |" in line_block
