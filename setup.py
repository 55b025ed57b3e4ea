"""Build hook: the wheel carries the Spark defaults and log4j2 settings of ``conf/``, the
shim jar of every supported Spark line (``SPARK_LINES`` in ``spark/shim.py``) as package
data under ``pyspark_safetensors/spark/resources/`` (found with ``importlib.resources``),
and the optional C cast kernel (the package falls back to numpy without a compiler).
Everything else is declared in pyproject.toml.

Building a wheel or an sdist (``pip wheel .``, ``python -m build``) first builds every
line's jar with ``jvm-shim/build.sh`` (a no-op for a jar already current, a copy for one
in its cache), with the Scala compiler inside that line's pyspark: the one of
``.venv-spark/<line>`` (``./dev jars`` makes them) or of this interpreter when it is that
release, else one pip installs from PyPI into ``$PYSPARK_SAFETENSORS_CACHE/pyspark/<release>``
(default ``~/.cache/pyspark-safetensors``). Without Java, or where a line's pyspark cannot
be had, the build stops with one line saying how. An unpacked sdist ships its jars and
builds none."""

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist
from setuptools.errors import ExecError

ROOT = Path(__file__).resolve().parent
RESOURCES = ["conf/spark-defaults.conf", "conf/log4j2.properties"]
TARGET = ROOT / "jvm-shim" / "target"


def _spark_lines() -> dict[str, tuple[str, str]]:
    """``SPARK_LINES`` of spark/shim.py, read without importing the package (whose
    dependencies a build environment lacks)."""
    tree = ast.parse((ROOT / "python/pyspark_safetensors/spark/shim.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "SPARK_LINES":
            return ast.literal_eval(node.value)
    raise ExecError("no SPARK_LINES in python/pyspark_safetensors/spark/shim.py")


def _version() -> str:
    text = (ROOT / "python/pyspark_safetensors/_version.py").read_text()
    return re.search(r'__version__ = "(.+?)"', text).group(1)


def _cache() -> Path:
    home = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(os.environ.get("PYSPARK_SAFETENSORS_CACHE") or Path(home, "pyspark-safetensors"))


def _pyspark_of(python: str, env: dict[str, str]) -> str | None:
    """The pyspark release ``python`` imports, or None."""
    probe = "import importlib.metadata as m; print(m.version('pyspark'))"
    run = subprocess.run([python, "-c", probe], env=env, capture_output=True, text=True)
    return run.stdout.strip() if run.returncode == 0 else None


def _line_python(line: str, release: str) -> tuple[str, dict[str, str]]:
    """A python (and its environment) whose pyspark is ``release``, installed from PyPI
    into the cache when neither ``.venv-spark/<line>`` nor this interpreter has it."""
    # Without PYTHONPATH: pip's isolated build environment sets one whose sitecustomize
    # hides this interpreter's site-packages, where a line environment finds the packages
    # it shares with .venv (py4j for one)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    line_env = ROOT / ".venv-spark" / line / "bin" / "python"
    for python in (line_env, Path(sys.executable)):
        if python.is_file() and _pyspark_of(str(python), env) == release:
            return str(python), env
    target = _cache() / "pyspark" / release
    if not target.is_dir():
        print(f"installing pyspark {release} into {target} for the Spark {line} jar", flush=True)
        partial = target.with_name(f"{release}.{os.getpid()}.partial")
        pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", "install"]
        run = subprocess.run(
            [*pip, "--no-compile", "--target", str(partial), f"pyspark=={release}"],
            capture_output=True,
            text=True,
        )
        if run.returncode != 0:
            shutil.rmtree(partial, ignore_errors=True)
            last = (run.stderr.strip().splitlines() or ["pip failed"])[-1]
            raise ExecError(
                f"the Spark {line} shim jar needs pyspark {release}, which pip could not "
                f"install ({last}): run './dev jars' where PyPI is reachable, or put that "
                f"pyspark in .venv-spark/{line}"
            )
        try:
            partial.rename(target)
        except OSError:  # another build installed it meanwhile: keep theirs
            shutil.rmtree(partial, ignore_errors=True)
            if not target.is_dir():  # no: the rename itself failed
                raise
    return sys.executable, {**env, "PYTHONPATH": str(target)}


def build_shim_jars() -> list[Path]:
    """Every supported line's shim jar, built where missing or stale; their paths."""
    names = {
        line: f"pyspark-safetensors-shim-{line}_{scala}-{_version()}.jar"
        for line, (_, scala) in _spark_lines().items()
    }
    if (ROOT / "PKG-INFO").is_file() and all((TARGET / n).is_file() for n in names.values()):
        return [TARGET / name for name in names.values()]  # an unpacked sdist
    home = os.environ.get("JAVA_HOME")
    if not (shutil.which(os.path.join(home, "bin", "java")) if home else shutil.which("java")):
        raise ExecError(
            "building pyspark-safetensors compiles its JVM shim for every Spark line and "
            "needs Java 17 or newer, which was not found: install a JDK (e.g. 'apt-get "
            "install openjdk-17-jdk-headless') and put 'java' on PATH, or set JAVA_HOME"
        )
    jars = []
    for line, (release, _) in _spark_lines().items():
        python, env = _line_python(line, release)
        run = subprocess.run(
            ["bash", str(ROOT / "jvm-shim" / "build.sh"), python], env=env, capture_output=True
        )
        jar = TARGET / names[line]
        if run.returncode != 0 or not jar.is_file():
            last = (run.stderr.decode(errors="replace").strip().splitlines() or ["no output"])[-1]
            raise ExecError(f"jvm-shim/build.sh made no {jar.name} for Spark {line}: {last}")
        jars.append(jar)
    return jars


class build_py_with_resources(build_py):
    def run(self):
        super().run()
        if self.editable_mode:  # an editable install reads conf/ and jvm-shim/ in place
            return
        dest = Path(self.build_lib, "pyspark_safetensors", "spark", "resources")
        dest.mkdir(parents=True, exist_ok=True)
        for old in dest.glob("pyspark-safetensors-shim-*.jar"):  # a build/ of another version
            old.unlink()
        for path in [*(ROOT / p for p in RESOURCES), *build_shim_jars()]:
            shutil.copy2(path, dest / path.name)


class sdist_with_jars(sdist):
    """The sdist ships every line's jar (MANIFEST.in), so a wheel built from it needs
    neither Java nor pyspark."""

    def run(self):
        build_shim_jars()
        super().run()


FASTCAST = Extension(
    "pyspark_safetensors.format._fastcast",
    sources=["python/pyspark_safetensors/format/_fastcast.c"],
    extra_compile_args=["-O3"],
    optional=True,
)

setup(
    cmdclass={"build_py": build_py_with_resources, "sdist": sdist_with_jars},
    ext_modules=[FASTCAST],
)
