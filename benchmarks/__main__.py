"""python -m benchmarks [name ...] — run benchmarks and update docs/BENCHMARKS.md."""

from __future__ import annotations

import importlib
import platform
import re
import sys
from pathlib import Path

ALL = [
    "casts",
    "header",
    "writer",
    "reader",
    "functions",
    "loader",
    "sae",
    "lut",
    "extract",
    "saev",
    "zarr",
    "storage",
]
# Run by name only: sae_quality (minutes, and the optional 'baselines' extra), lines
# (half an hour: every Spark line installed by `./dev test-spark LINE`), reader_scale
# (writes 8 GB; minutes) and synth (ours against SAELens' SynthSAEBench runner: sae-lens,
# minutes of CPU).
DOC = Path(__file__).resolve().parent.parent / "docs" / "BENCHMARKS.md"


def machine() -> str:
    import os

    import pyspark

    return (
        f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"pyspark {pyspark.__version__}"
    )


def block_for_this_line(name: str, body: str) -> tuple[str, str]:
    """The benchmark's block in the doc and its text: on the newest Spark line, ``name`` and
    ``body``; on another, the name and the line (``writer@spark-3.5``), so that line's run
    keeps the newest's figures, and a heading that names the line."""
    from pyspark_safetensors.spark.shim import SPARK_LINES, spark_line

    line = spark_line()
    if line == list(SPARK_LINES)[-1]:  # oldest first
        return name, body
    labelled = re.sub(r"^(## .*)$", rf"\1 (Spark {line})", body, count=1, flags=re.M)
    return f"{name}@spark-{line}", labelled


def update(name: str, body: str) -> None:
    text = DOC.read_text() if DOC.exists() else "# Benchmarks\n"
    block = f"<!-- bench:{name} -->\n{body.strip()}\n<!-- /bench:{name} -->"
    tag = re.escape(name)
    pattern = re.compile(rf"<!-- bench:{tag} -->.*?<!-- /bench:{tag} -->", re.S)
    text = (
        pattern.sub(lambda _: block, text)
        if pattern.search(text)
        else text.rstrip() + "\n\n" + block + "\n"
    )
    DOC.write_text(text)


def available() -> list[str]:
    """Every benchmark's name: ``ALL`` and those run by name only."""
    found = sorted(p.stem[len("bench_") :] for p in Path(__file__).parent.glob("bench_*.py"))
    return ALL + [name for name in found if name not in ALL]


def main(argv: list[str]) -> int:
    names = available()
    if argv[:1] in (["-h"], ["--help"]):
        by_name = [name for name in names if name not in ALL]
        print(
            f"{__doc__.strip()}\n\nwithout a name: {' '.join(ALL)}\nby name only: {' '.join(by_name)}"
        )
        return 0
    unknown = [name for name in argv if name not in names]
    if unknown:  # before anything runs: a typo must not cost the benchmarks before it
        print(
            f"error: unknown benchmark {', '.join(map(repr, unknown))} "
            f"(benchmarks: {', '.join(names)})",
            file=sys.stderr,
        )
        return 2
    for name in argv or ALL:
        module = importlib.import_module(f"benchmarks.bench_{name}")
        print(f"== {name}", flush=True)
        body = module.run()
        print(body, flush=True)
        # a benchmark whose settings change what it measures names its own block
        block = module.block() if hasattr(module, "block") else name
        update(*block_for_this_line(block, body + f"\n\n_Measured on {machine()}._"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
