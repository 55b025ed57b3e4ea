"""``./dev bench`` rewrites its own blocks of docs/BENCHMARKS.md in place and leaves the
rest of the page as it is; another Spark line's block says which line it measured."""

import pytest

import benchmarks.__main__ as bench

pytestmark = pytest.mark.unit

SECTION = "## Spark writer: 200,000 rows\n\n| a |\n|---|\n| {} |"


def test_a_block_is_replaced_in_place_and_another_lines_heading_names_it(tmp_path, monkeypatch):
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text("# Benchmarks\n\n## Findings\n\nwritten by hand\n")
    monkeypatch.setattr(bench, "DOC", doc)
    bench.update("writer", SECTION.format(1))
    bench.update("writer@spark-3.5", SECTION.format(2))
    bench.update("writer", SECTION.format(3))  # the newest line's figures, again
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\n## Findings\n\nwritten by hand\n")
    assert text.count("<!-- bench:writer -->") == 1 and "| 1 |" not in text
    newest, line = text.split("<!-- bench:writer@spark-3.5 -->")
    assert "## Spark writer: 200,000 rows\n" in newest and "| 3 |" in newest
    assert "## Spark writer: 200,000 rows (Spark 3.5)\n" in line and "| 2 |" in line
