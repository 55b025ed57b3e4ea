"""Bytecode in the archives Spark's Python processes import pyspark from, so that each of
them imports it on 0.19 s of CPU instead of 0.48 s.

Every Python process Spark starts (a data source's planners: lookup, schema, partitions,
write, commit; the daemons of UDF and task workers) puts
``$SPARK_HOME/python/lib/pyspark.zip`` and py4j's zip first on its ``sys.path``, before
site-packages. pip's pyspark ships these zips as sources only, and Python never writes
bytecode into a zip: each such process compiles some 200 modules of pyspark again, about
0.3 s of CPU (0.48 s for ``import pyspark`` and a planner's module, against 0.19 s with
bytecode; 2 cores, Python 3.11). A job that writes and reads the Python source starts ten
of them; a test suite, hundreds.

:func:`add_bytecode` adds to each zip the bytecode of the running Python for every module
but pyspark's own tests, as pip compiles site-packages at install: the sources stay as they
were, each ``.pyc`` is checked against its source's hash when imported, and another
Python's processes ignore them (another magic number) and compile as before. The tests
(919 of pyspark 4.3's 1,286 modules) stay sources: no Spark process imports them, and
every entry costs each new worker. Spark calls ``importlib.invalidate_caches()`` when it
sets up a worker, and Python 3.10 to 3.12 then read the zip's whole directory again
(3.13 on its next import from it): 42 ms for pyspark.zip as shipped, 79 ms with every
module's bytecode, 53 ms with all but the tests'. ``./dev`` does it at set-up; elsewhere
``python -m pyspark_safetensors.spark.worker_bytecode`` does (once per pyspark install; a
reinstalled pyspark brings its zips back without bytecode).
"""

from __future__ import annotations

import importlib.util
import marshal
import os
import sys
import time
import warnings
import zipfile
from pathlib import Path

from .shim import spark_home

_MODULE = "pyspark_safetensors.spark.worker_bytecode"

# A pyc's header (PEP 552): the magic number, then flags 0b11, a hash-based pyc whose
# source's hash zipimport checks before using it, then that hash and the code.
_CHECKED_HASH_PYC = importlib.util.MAGIC_NUMBER + (0b11).to_bytes(4, "little")


def spark_python_zips(home: str | os.PathLike | None = None) -> list[Path]:
    """The zips Spark puts on its Python processes' path: ``python/lib/*.zip`` of the Spark
    install (default: :func:`~pyspark_safetensors.spark.shim.spark_home`)."""
    lib = Path(home or spark_home()) / "python" / "lib"
    return sorted(lib.glob("*.zip")) if lib.is_dir() else []


def _compiled(name: str) -> bool:
    """Whether the zip entry ``name`` is a module that gets bytecode: a test's does not."""
    return name.endswith(".py") and "tests" not in name.split("/")[:-1]


def has_bytecode(path: str | os.PathLike) -> bool:
    """Whether every module of the zip but the tests has bytecode of the running Python,
    and no test has any."""
    magic = importlib.util.MAGIC_NUMBER
    with zipfile.ZipFile(path) as archive:
        names = set(archive.namelist())
        sources = [n for n in names if _compiled(n)]
        if not sources or any(f"{n}c" not in names for n in sources):
            return False
        if any(n.endswith(".pyc") and not _compiled(n[:-1]) for n in names):
            return False
        with archive.open(f"{sources[0]}c") as pyc:
            return pyc.read(len(magic)) == magic


def add_bytecode(path: str | os.PathLike) -> int:
    """Rewrite the zip with a ``.pyc`` of the running Python beside each ``.py`` but the
    tests' (another Python's, and any test's, removed); the sources and every other entry
    are kept. The new zip replaces the old one whole, so a failure leaves the old one. Run
    it while no Spark job runs: a Python process reads modules at the offsets of the zip it
    opened. Returns the number of modules compiled."""
    path = Path(path)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    compiled = 0
    try:
        with zipfile.ZipFile(path) as old, zipfile.ZipFile(partial, "w") as new:
            for entry in old.infolist():
                if entry.filename.endswith(".pyc"):
                    continue  # another Python's (or an earlier run's): compiled again below
                data = old.read(entry)
                new.writestr(entry, data)
                if not _compiled(entry.filename):
                    continue
                # As zipimport names a module it compiles: the archive's path, then the
                # file's; tracebacks read the same as without bytecode.
                origin = f"{path}{os.sep}{entry.filename}"
                with warnings.catch_warnings():  # a source's own SyntaxWarnings
                    warnings.simplefilter("ignore")
                    code = compile(data, origin, "exec", dont_inherit=True)
                pyc = _CHECKED_HASH_PYC + importlib.util.source_hash(data) + marshal.dumps(code)
                info = zipfile.ZipInfo(f"{entry.filename}c", entry.date_time)
                info.compress_type = zipfile.ZIP_DEFLATED
                new.writestr(info, pyc)
                compiled += 1
        os.chmod(partial, path.stat().st_mode & 0o777)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return compiled


def main(argv: list[str]) -> int:
    """Add bytecode to each of Spark's Python zips that lacks it and print what was done
    (``--quiet``: only what was compiled). Exits 1 where a zip cannot be rewritten."""
    import argparse

    parser = argparse.ArgumentParser(
        prog=f"python -m {_MODULE}",
        description="Add the running Python's bytecode to the zips Spark's Python processes "
        "import pyspark from (once per pyspark install).",
    )
    parser.add_argument("--quiet", action="store_true", help="print only what was compiled")
    args = parser.parse_args(argv)
    zips = spark_python_zips()
    if not zips and not args.quiet:
        print(f"no zips under {spark_home()}/python/lib: nothing to do")
    for path in zips:
        if has_bytecode(path):
            if not args.quiet:
                print(f"{path}: has bytecode")
            continue
        started = time.perf_counter()
        try:
            count = add_bytecode(path)
        except OSError as e:
            print(f"{path}: cannot be rewritten ({e}); its modules compile in each process")
            return 1
        print(f"{path}: bytecode of {count} modules added in {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
