"""Every fenced python, sql and bash block of README.md and docs/*.md runs as written.

One process per file, in a fresh working directory (holding a copy of ``conf/``) with
``PYSPARK_PYTHON`` set: its blocks run in order, so they share one Spark session. A python
block runs in a fresh namespace unless the line before its fence is ``<!-- continues -->``
(then it sees the names of the python block before it); ``<!-- skip: reason -->`` leaves a block out.
sql blocks run statement by statement in the active (or a new local) Spark session; bash
blocks run with ``bash -euo pipefail``.

Run one file by hand: ``python tests/test_docs.py docs/functions.md`` (in an empty directory).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LANGUAGES = {"python": "python", "sql": "sql", "bash": "bash", "sh": "bash"}
FENCE = re.compile(r"^```([A-Za-z]*)[^\n]*$")
MARKER = re.compile(r"^<!--\s*(skip|continues)\b:?\s*(.*?)\s*-->$")


@dataclass
class Block:
    line: int
    language: str
    code: str
    skip: str | None
    continues: bool


def blocks(text: str) -> list[Block]:
    """The runnable fenced blocks of a markdown text, with the marker before each."""
    found, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        language = LANGUAGES.get(fence.group(1).lower())
        before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = MARKER.match(before)
        if language is not None:
            found.append(
                Block(
                    line=i + 1,
                    language=language,
                    code="\n".join(lines[i + 1 : end]) + "\n",
                    skip=(marker.group(2) or "no reason given")
                    if marker and marker.group(1) == "skip"
                    else None,
                    continues=bool(marker and marker.group(1) == "continues"),
                )
            )
        i = end + 1
    return found


def _spark():
    from pyspark.sql import SparkSession

    return SparkSession.getActiveSession() or SparkSession.builder.master("local[2]").getOrCreate()


def run_file(path: Path) -> int:
    """Run the blocks of one markdown file in this process; returns the number that failed."""
    failed, namespace, previous_ok = 0, {}, True
    for block in blocks(path.read_text()):
        where = f"{path.name}:{block.line} ({block.language})"
        if block.skip:
            print(f"skip {where}: {block.skip}", flush=True)
            continue
        if block.continues and not previous_ok:
            print(f"FAIL {where}: continues a block that failed", file=sys.stderr, flush=True)
            failed += 1
            continue
        if block.language == "python" and not block.continues:
            namespace = {"__name__": "__main__"}
        print(f"run  {where}", flush=True)
        try:
            if block.language == "python":
                exec(compile(block.code, where, "exec"), namespace)
            elif block.language == "sql":
                for statement in filter(str.strip, block.code.split(";")):
                    _spark().sql(statement).collect()
            else:
                subprocess.run(["bash", "-euo", "pipefail", "-c", block.code], check=True)
            previous_ok = True
        except BaseException:
            previous_ok = False
            failed += 1
            print(f"FAIL {where}:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
    return failed


# ---------------------------------------------------------------- the tests

DOCS = ["README.md", *sorted(p.relative_to(REPO).as_posix() for p in (REPO / "docs").glob("*.md"))]


def _docs_with_blocks():
    return [d for d in DOCS if any(not b.skip for b in blocks((REPO / d).read_text()))]


def test_markers_are_well_placed():
    for doc in DOCS:
        found = blocks((REPO / doc).read_text())
        if found and found[0].continues:
            raise AssertionError(f"{doc}:{found[0].line}: the first block cannot continue another")
        for block in found:
            assert not (block.continues and block.language != "python"), (
                f"{doc}:{block.line}: only python blocks continue the previous one"
            )


# The pages that run the research stages (extraction, features, training) take minutes
# each: a class of their own, which xdist's loadscope runs beside the other pages' class.
STAGE_PAGES = ("README.md", "docs/extract.md", "docs/features.md")


def pytest_generate_tests(metafunc):
    if "doc" in metafunc.fixturenames:
        stages = metafunc.cls is TestStagePages
        docs = [d for d in _docs_with_blocks() if (d in STAGE_PAGES) == stages]
        metafunc.parametrize("doc", docs)


class TestStagePages:
    def test_doc_blocks_run(self, doc, tmp_path):
        run_doc(doc, tmp_path)


class TestPages:
    def test_doc_blocks_run(self, doc, tmp_path):
        run_doc(doc, tmp_path)


def run_doc(doc, tmp_path):
    """Run one page's blocks in a fresh process in ``tmp_path``; fails with their errors."""
    shutil.copytree(REPO / "conf", tmp_path / "conf")
    # As in an activated environment: bash blocks' `python` and console scripts are ours.
    bin_dir = os.path.dirname(sys.executable)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
    }
    proc = subprocess.run(
        [sys.executable, __file__, str(REPO / doc)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, "\n".join(
        line for line in proc.stderr.splitlines() if not re.match(r"^\s*at |.* WARN ", line)
    )[-8000:]


def _exit(code: int):
    """End the page's process with ``code`` once its blocks are done, without interpreter
    finalisation. Why: a native worker thread (Arrow's pools, gloo's) that takes the GIL
    while the interpreter finalises is unwound inside C++ and aborts the process
    ("terminate called without an active exception", SIGABRT) after every block passed
    (apache/arrow#34314); the page's result is already known, so nothing is lost."""
    from pyspark.sql import SparkSession

    session = SparkSession.getActiveSession()
    if session is not None:
        session.stop()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit(min(run_file(Path(sys.argv[1])), 100))
