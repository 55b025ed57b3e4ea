"""How far each trained figure stays from its threshold across what varies between machines.

A test marked ``trained`` checks a figure that comes out of training (a held-out FVU, an
AUROC, a CE loss recovered) with the ``figure`` fixture, which records it. This script
runs those tests once per condition and tabulates, per figure, its value under each, its
spread and its margin (the smallest distance to the threshold, as a fraction of it):

- torch at 1 and at 2 threads (``PSS_TEST_THREADS``; Spark workers and torchrun processes
  inherit OMP_NUM_THREADS);
- seeds 1 to 4 of the data, the model and the run (``PSS_TEST_SEED``, the ``seed`` fixture);
- deterministic kernels (``PSS_TEST_DETERMINISTIC``: ``torch.use_deterministic_algorithms``);
- the kernels each library picks for this CPU (``PSS_TEST_NATIVE_KERNELS``) instead of
  the suite's pinned path (``tests/cpu_path.py``), which makes a figure the same bits on
  every x86-64 CPU with AVX2: this condition is what another CPU would see without it.

    python tests/margins.py [pytest arguments, e.g. tests/features/test_toy_vit.py]
    PSS_MARGINS="2 threads,native kernels" python tests/margins.py ...   # some conditions only

Below the table, the fingerprint of each condition (a hash of every figure's exact value)
and each figure's exact value under the first: two machines that print the same
fingerprint gave the same bits for every figure (``docs/reproducibility.md`` records them).

A test's docstring states the spread this printed. Several runs of the trained tests:
minutes, so it is a tool, not part of the suite.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

#: name -> environment of one condition (the first is the reference).
CONDITIONS = {
    "2 threads": {"PSS_TEST_THREADS": "2"},
    "1 thread": {"PSS_TEST_THREADS": "1"},
    "seed 1": {"PSS_TEST_THREADS": "2", "PSS_TEST_SEED": "1"},
    "seed 2": {"PSS_TEST_THREADS": "2", "PSS_TEST_SEED": "2"},
    "seed 3": {"PSS_TEST_THREADS": "2", "PSS_TEST_SEED": "3"},
    "seed 4": {"PSS_TEST_THREADS": "2", "PSS_TEST_SEED": "4"},
    "deterministic": {"PSS_TEST_THREADS": "2", "PSS_TEST_DETERMINISTIC": "1"},
    "native kernels": {"PSS_TEST_THREADS": "2", "PSS_TEST_NATIVE_KERNELS": "1"},
}


def run_condition(env: dict[str, str], args: list[str], report: Path) -> int:
    """The trained tests under one condition, their JUnit report at ``report``."""
    command = [sys.executable, "-m", "pytest", "-m", "trained", "-q", "-p", "no:cacheprovider",
               "-n", "2", "--dist", "loadscope", "-o", "junit_family=legacy", f"--junitxml={report}", *args]  # fmt: skip
    # pytest's own output goes to stderr: stdout is the table
    run = subprocess.run(command, cwd=REPO, env=os.environ | env, stdout=sys.stderr, check=False)
    return run.returncode


def figures(report: Path) -> dict[str, tuple[float, str, bool]]:
    """``{test::figure: (value, threshold, timed)}`` recorded in one JUnit report."""
    out = {}
    for case in ET.parse(report).iter("testcase"):
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        for key, value in props.items():
            if key.startswith("figure:"):
                name = key.removeprefix("figure:")
                test = case.get("name").split("[")[0].removeprefix("test_")[:40]
                param = case.get("name").partition("[")[2].rstrip("]")
                module = case.get("classname").rsplit(".", 1)[-1]
                where = f"{module}::{test}{f'[{param}]' if param else ''}::{name}"
                out[where] = (float(value), props.get(f"threshold:{name}", ""),
                              f"timed:{name}" in props)  # fmt: skip
    return out


def margin(values: list[float], threshold: str) -> float:
    """The worst distance of ``values`` to ``threshold`` ("> t" or "< t"), relative to t."""
    op, bound = threshold.split()
    t = float(bound)
    worst = min(values) - t if op == ">" else t - max(values)
    return worst / abs(t) if t else worst


def table(results: dict[str, dict[str, tuple[float, str, bool]]]) -> str:
    names = sorted({n for r in results.values() for n in r})
    conditions = list(results)
    lines = [
        "| figure | threshold | " + " | ".join(conditions) + " | spread | margin |",
        "|---|---|" + "---|" * len(conditions) + "---|---|",
    ]
    for name in names:
        got = [results[c].get(name) for c in conditions]
        values = [g[0] for g in got if g]
        threshold = next(g[1] for g in got if g)
        cells = [f"{g[0]:.4f}" if g else "-" for g in got]
        spread = max(values) - min(values)
        lines.append(f"| {name} | {threshold} | " + " | ".join(cells)
                     + f" | {spread:.4f} | {margin(values, threshold):+.1%} |")  # fmt: skip
    return "\n".join(lines)


def fingerprint(figures: dict[str, tuple[float, str, bool]]) -> str:
    """A hash of every figure's exact value (and its name), timed ones left out: equal
    fingerprints, equal bits."""
    body = "\n".join(f"{name}={value.hex()}" for name, (value, _, timed) in sorted(figures.items())
                      if not timed)  # fmt: skip
    return hashlib.sha256(body.encode()).hexdigest()[:16]


def fingerprints(results: dict[str, dict[str, tuple[float, str, bool]]]) -> str:
    first = next(iter(results.values()), {})
    lines = ["", "| condition | figures | fingerprint |", "|---|---|---|"]
    lines += [f"| {c} | {len(f)} | `{fingerprint(f)}` |" for c, f in results.items()]
    lines += ["", f"| figure | exact value under {next(iter(results), '-')} |", "|---|---|"]
    lines += [f"| {name} | `{value.hex()}`{' (timed: not in the fingerprint)' if timed else ''} |"
              for name, (value, _, timed) in sorted(first.items())]  # fmt: skip
    return "\n".join(lines)


def main(args: list[str]) -> int:
    results = {}
    chosen = [c.strip() for c in os.environ.get("PSS_MARGINS", "").split(",") if c.strip()]
    unknown = set(chosen) - set(CONDITIONS)
    if unknown:
        sys.exit(f"unknown condition(s) {sorted(unknown)}: known are {list(CONDITIONS)}")
    with tempfile.TemporaryDirectory() as tmp:
        for name, env in CONDITIONS.items():
            if chosen and name not in chosen:
                continue
            report = Path(tmp) / f"{len(results)}.xml"
            print(f"== {name}", file=sys.stderr, flush=True)
            run_condition(env, args, report)
            results[name] = figures(report) if report.exists() else {}
    print(table(results))
    print(fingerprints(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
