"""The JVM source on every supported Spark line: the writer and reader benchmarks' JVM cases
(200,000 x 256 float32, local[2]) run on each line installed beside the project, with
Spark's parquet writer and reader and, on the 4.x lines, the Scala connector in the same
session.

Each line runs in its own process with its own pyspark (``.venv-spark/LINE``, made by
``./dev test-spark LINE``; the newest line is the project's ``.venv``), twice, the lines in
turn and then in reverse, so slow drifts of the machine touch every line alike; each
figure is the faster of the two sessions' medians. ``SCALA_CONNECTOR_SRC`` names a checkout
of the connector's sources: it is built for each 4.x line with that line's own pyspark
(``benchmarks/build_scala_connector.sh``); it has no Spark 3.5 build.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.bench_writer import DIM, JVM_SOURCE, ROWS, SCALA_CONNECTOR, make_df
from benchmarks.common import interleaved_medians, table

REPEAT = 5
ROOT = Path(__file__).resolve().parent.parent
READS = {"rows": "read rows → noop", "count": "count()", "tensors": "read tensors → noop"}


def _measure(connector: bool) -> dict[str, float]:
    """In a line's own process: every case's median seconds, keyed ``"who | case"``."""
    from pyspark_safetensors.spark.session import local_session
    from pyspark_safetensors.spark.shim import shim_jar

    jars = [str(shim_jar())] + ([os.environ["SCALA_CONNECTOR_JAR"]] if connector else [])
    spark = local_session(
        "local[2]", **{"spark.ui.showConsoleProgress": "false", "spark.jars": ",".join(jars)}
    )
    out = Path(tempfile.mkdtemp(prefix="bench-lines-"))
    try:
        df = make_df(spark)
        acts = df.select("activation")

        def save(fmt, frame, name, **options):
            return lambda: (
                frame.write.format(fmt).options(**options).mode("overwrite").save(str(out / name))
            )

        writers = {"jvm": (JVM_SOURCE, {})}
        if connector:  # the connector's dtype option is required for arrays
            writers["scala connector"] = (SCALA_CONNECTOR, {"dtype": "F32"})
        cases = {
            "parquet | write parquet": save("parquet", acts, "pq"),
            "parquet | write parquet with key": save("parquet", df, "pqkv"),
        }
        for who, (fmt, opts) in writers.items():
            cases |= {
                f"{who} | write batch F32": save(fmt, acts, f"{who}32", batch_size=10_000, **opts),
                f"{who} | write batch F16": save(
                    fmt, acts, f"{who}16", batch_size=10_000, **{**opts, "dtype": "F16"}
                ),
                f"{who} | write KV F32": save(fmt, df, f"{who}kv", name_col="key", **opts),
            }
        seconds = interleaved_medians(cases, repeat=REPEAT, settle=os.sync)
        df.unpersist()

        def noop(frame):
            return lambda: frame().write.format("noop").mode("overwrite").save()

        dataset = str(out / "jvm32")
        jvm = lambda **o: spark.read.format(JVM_SOURCE).options(**o).load(dataset)  # noqa: E731
        reads = {
            "parquet | read rows → noop": noop(lambda: spark.read.parquet(str(out / "pq"))),
            "parquet | count()": lambda: spark.read.parquet(str(out / "pq")).count(),
            "jvm | read rows → noop": noop(jvm),
            "jvm | count()": lambda: jvm().count(),
            "jvm | read tensors → noop": noop(lambda: jvm(view="tensors")),
        }
        if connector:
            reads["scala connector | read tensors → noop"] = noop(
                lambda: (
                    spark.read.format(SCALA_CONNECTOR).option("inferSchema", "true").load(dataset)
                )
            )
        seconds |= interleaved_medians(reads, repeat=REPEAT, settle=os.sync)
    finally:
        spark.stop()
        shutil.rmtree(out, ignore_errors=True)
    return seconds


def _lines() -> dict[str, Path]:
    """Each supported line with an interpreter whose pyspark is that line."""
    from pyspark_safetensors.spark.shim import SPARK_LINES, spark_line

    found = {}
    for line in SPARK_LINES:
        python = ROOT / ".venv-spark" / line / "bin" / "python"
        if line == spark_line():
            python = Path(sys.executable)
        if python.exists():
            found[line] = python
    return found


def _connector_jar(line: str, python: Path) -> str | None:
    source = os.environ.get("SCALA_CONNECTOR_SRC")
    if not source or line.startswith("3."):
        return None
    jar = ROOT / "benchmarks" / "target" / f"safetensors-spark-for-spark-{line}.jar"
    if not jar.exists():
        built = subprocess.run(
            [str(ROOT / "benchmarks" / "build_scala_connector.sh"), source, str(python)],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.split()[-1]
        shutil.move(built, jar)
    return str(jar)


def _session(line: str, python: Path, connector: str | None) -> dict[str, float]:
    env = {**os.environ, "PYSPARK_PYTHON": str(python), "PYSPARK_DRIVER_PYTHON": str(python)}
    env.pop("SCALA_CONNECTOR_JAR", None)
    if connector:
        env["SCALA_CONNECTOR_JAR"] = connector
    print(f"   Spark {line}", flush=True)
    done = subprocess.run(
        [str(python), "-m", "benchmarks.bench_lines", "--one-line"],
        cwd=ROOT,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else ""


def _row(s: dict[str, float], newest: dict[str, float]) -> list[str]:
    """One line's cells: the JVM source's seconds, then the ratios of the table's header."""

    def jvm(case):
        return s.get(f"jvm | {case}")

    def scala(case):
        return s.get(f"scala connector | {case}")

    writes = ("write batch F32", "write batch F16", "write KV F32")
    return [
        *(f"{jvm(c):.2f}" for c in writes),
        *(f"{jvm(c):.2f}" for c in READS.values()),
        _ratio(
            newest["jvm | write batch F32"] + newest["jvm | write KV F32"],
            jvm("write batch F32") + jvm("write KV F32"),
        ),
        _ratio(newest["jvm | read rows → noop"], jvm("read rows → noop")),
        *(_ratio(scala(c), jvm(c)) for c in writes),
        _ratio(s["parquet | write parquet"], jvm("write batch F32")),
        _ratio(s["parquet | read rows → noop"], jvm("read rows → noop")),
        _ratio(scala("read tensors → noop"), jvm("read tensors → noop")),
    ]


def run() -> str:
    import pyspark

    lines = _lines()
    newest = list(lines)[-1]  # in SPARK_LINES's order, oldest first
    connectors = {line: _connector_jar(line, python) for line, python in lines.items()}
    versions = {
        line: subprocess.run(
            [str(python), "-c", "import pyspark; print(pyspark.__version__)"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for line, python in lines.items()
    }
    sessions: dict[str, list[dict[str, float]]] = {line: [] for line in lines}
    for order in (list(lines), list(reversed(lines))):
        for line in order:
            sessions[line].append(_session(line, lines[line], connectors[line]))
    best = {
        line: {case: min(s[case] for s in runs) for case in runs[0]}
        for line, runs in sessions.items()
    }

    rows = [
        [f"{line} ({versions[line]})", *_row(figures, best[newest])]
        for line, figures in best.items()
    ]
    mb = ROWS * DIM * 4 / 1e6
    return (
        f"## The JVM source on every Spark line: {ROWS:,} × {DIM} float32 ({mb:.0f} MB), "
        "local[2]\n\n"
        f"Seconds (median of {REPEAT}, the faster of two sessions per line, the lines taken "
        "in turn and then in reverse) of the JVM source's writes (batch_size=10,000; KV one "
        "tensor per row) and reads of the batch F32 dataset, then ratios (above 1: ours "
        f"faster): the line's writes (batch F32 + KV) and rows read against Spark {newest}'s, "
        "against the Scala connector in the same session (built for that line from its "
        "sources; it has no 3.5 build), and against Spark's parquet writer and reader.\n\n"
        + table(
            [
                "Spark",
                "batch F32",
                "batch F16",
                "KV F32",
                "rows → noop",
                "count()",
                "tensors → noop",
                f"writes vs {newest}",
                f"rows vs {newest}",
                "batch F32 vs connector",
                "batch F16 vs connector",
                "KV vs connector",
                "batch F32 vs parquet",
                "rows vs parquet",
                "tensors vs connector",
            ],
            rows,
        )
        + f"\n\n_Driver: pyspark {pyspark.__version__}; each line's process runs its own._"
    )


if __name__ == "__main__":
    if sys.argv[1:] == ["--one-line"]:
        print(json.dumps(_measure(bool(os.environ.get("SCALA_CONNECTOR_JAR")))))
    else:
        print(run())
