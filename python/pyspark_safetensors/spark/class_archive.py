"""A class-data-sharing archive of the classes a local Spark driver loads, so that the
embedded session (and a ``local-cluster`` master's executors) start in about half the time.

A Spark driver parses and verifies some ten thousand classes from its jars while the
session starts and its first jobs run: most of the seconds before the first task. The JDK
can instead map those classes, already parsed, from an archive written once
(``-XX:ArchiveClassesAtExit``, JDK 13 and newer) and read by every later JVM of the same
runtime and class path (``-XX:SharedArchiveFile``). The JVM checks each jar on the class
path against the one recorded (size and modification time) and maps nothing where one
differs, so a Spark reinstalled at the same path makes an archive stale: a stamp of the
jars written beside it tells, and a stale archive is not passed (set-up builds it again).

:func:`build` writes the archive (a local session running a representative set of jobs,
about a minute and 190 MB, once per Spark install and Java runtime); :func:`java_options`
gives the JVM flags once it exists, and ``local_session()`` passes them. ``./dev`` builds
it at set-up; elsewhere ``python -m pyspark_safetensors.spark.class_archive`` does. The
cache directory may be deleted at any time (an upgraded Spark or Java leaves its old
archive there).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from .shim import spark_home

CACHE_ENV = "PYSPARK_SAFETENSORS_CACHE"
"""A directory for the archive instead of ``$XDG_CACHE_HOME/pyspark-safetensors``."""

# The JVM's CDS log lines (one per class it cannot archive, printed to stdout while
# writing; a warning for an archive it cannot map) say nothing a user acts on.
_QUIET = "-Xshare:auto -Xlog:cds=off -Xlog:cds+dynamic=off"

_MODULE = "pyspark_safetensors.spark.class_archive"  # run as a script, __name__ is __main__
_RECORDER = "pyspark_safetensors.spark.record_classes"  # the recording session, a program

_OWN_FLAGS = ("SharedArchiveFile", "ArchiveClassesAtExit", "-Xshare")
"""Flags of a user's own class-data-sharing set-up, which then wins over ours."""


def _java() -> str:
    """The java Spark's launcher runs: ``$JAVA_HOME/bin/java``, else ``java`` on PATH."""
    home = os.environ.get("JAVA_HOME")
    java = os.path.join(home, "bin", "java") if home else shutil.which("java")
    return os.path.realpath(java) if java else "java"


def archive_path() -> Path:
    """Where the archive of this Spark install and Java runtime lives (it may not exist)."""
    import pyspark

    java = _java()
    home = spark_home()
    stamp = os.stat(java).st_mtime_ns if os.path.exists(java) else 0
    key = "\0".join([java, str(stamp), os.path.realpath(home), pyspark.__version__])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    cache = os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pyspark-safetensors"
    )
    return Path(cache) / "jvm" / f"spark-{pyspark.__version__}-{digest}.jsa"


def _jars_stamp() -> str:
    """What the JVM checks of the driver's class path: every Spark jar's name, size and
    modification time (a reinstall keeps the names and changes the times)."""
    jars = Path(spark_home()) / "jars"
    stats = [(p.name, p.stat()) for p in sorted(jars.iterdir())] if jars.is_dir() else []
    listing = "\n".join(f"{name} {st.st_size} {st.st_mtime_ns}" for name, st in stats)
    return hashlib.sha256(listing.encode()).hexdigest()


def _stamp_path(path: Path) -> Path:
    return path.with_name(f"{path.name}.jars")


def is_current(path: Path | None = None) -> bool:
    """Whether the archive is built for the Spark jars installed now."""
    path = path or archive_path()
    stamp = _stamp_path(path)
    return path.is_file() and stamp.is_file() and stamp.read_text() == _jars_stamp()


def java_options(path: Path | None = None) -> str:
    """The JVM flags that map the archive, or ``""`` when it is not built or stale."""
    path = path or archive_path()
    return f"-XX:SharedArchiveFile={path} {_QUIET}" if is_current(path) else ""


def recording_options(out: Path | str) -> str:
    """The JVM flags of a driver that writes the classes it loads to ``out`` as it exits."""
    return f"-XX:ArchiveClassesAtExit={out} {_QUIET}"


def with_archive(java_options_given: str) -> str:
    """``java_options_given`` (a session's ``spark.driver.extraJavaOptions``, its
    executors', ``SPARK_SUBMIT_OPTS``) with the archive's flags first, unless they set up
    class-data sharing themselves (which also makes applying it twice change nothing)."""
    if any(flag in java_options_given for flag in _OWN_FLAGS):
        return java_options_given
    return f"{java_options()} {java_options_given}".strip()


def build(path: Path | None = None, *, timeout: float = 900) -> Path:
    """Write the archive (replacing one there): a fresh process (``record_classes``) runs a
    local session with the jobs of a typical run and the JVM writes the classes it loaded as
    it exits; the file appears whole or not at all. Returns its path."""
    path = path or archive_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    try:
        run = subprocess.run(
            [sys.executable, "-m", _RECORDER, str(partial)],
            timeout=timeout,
            capture_output=True,
            text=True,
        )
        if run.returncode != 0:
            raise RuntimeError(f"building the JVM class archive failed:\n{run.stderr[-4000:]}")
        os.replace(partial, path)
        _stamp_path(path).write_text(_jars_stamp())
    finally:
        partial.unlink(missing_ok=True)
    return path


def main(argv: list[str]) -> int:
    """Build the archive where it is missing or stale (``--force``: in any case) and print
    its path (``--quiet``: only when built)."""
    import argparse

    parser = argparse.ArgumentParser(
        prog=f"python -m {_MODULE}",
        description="Archive the classes a Spark driver loads, for every embedded session "
        "after it to start sooner (once per Spark install and Java runtime).",
    )
    parser.add_argument("--force", action="store_true", help="build it even where it exists")
    parser.add_argument("--quiet", action="store_true", help="print its path only when built")
    args = parser.parse_args(argv)
    path = archive_path()
    if args.force or not is_current(path):
        started = time.perf_counter()
        build(path)
        print(f"JVM class archive built in {time.perf_counter() - started:.0f} s: {path}")
    elif not args.quiet:
        print(f"JVM class archive: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
