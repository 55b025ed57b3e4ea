"""The wheel and the sdist, built from a clean tree: the tracked files of this checkout, as
a clone of it would hold them, with no build output (no jars, no egg-info).

Without Java the build stops with one line saying how. With it, the wheel carries the shim
jar of every Spark line, each built for its line and loading there (the oldest and the
newest line each start a session with the jar taken from the wheel), the sdist carries
them too (a wheel built from it needs no Java), and the wheel installed into a fresh
virtual environment runs the README's first Spark example. Every line's pyspark comes from
``.venv-spark/<line>`` (``./dev jars`` makes them; CI's wheel stage runs it first): the
tests that build need all of them and are skipped, saying so, where one is missing."""

import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from pyspark_safetensors.spark.shim import SPARK_LINES, shim_jar_name

pytestmark = pytest.mark.spark

PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
RESOURCES = "pyspark_safetensors/spark/resources"
SERVICE = "META-INF/services/org.apache.spark.sql.sources.DataSourceRegister"


def first_spark_example(readme: str) -> str:
    blocks = re.findall(r"^```python\n(.*?)^```", readme, flags=re.S | re.M)
    return next(b for b in blocks if 'format("safetensors")' in b)


def clean_tree(repo_root: Path, dest: Path) -> Path:
    """The tracked files of the checkout (as they are in the working tree) copied to ``dest``."""
    listed = subprocess.run(
        ["git", "-C", repo_root, "ls-files", "-z"], check=True, capture_output=True
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = repo_root / name
        if source.is_file():  # a tracked file deleted in the working tree is left out
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


def line_python(repo_root: Path, line: str) -> Path:
    return repo_root / ".venv-spark" / line / "bin" / "python"


def build_wheel(src: Path, dist: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*PIP, "wheel", "--no-deps", "--no-build-isolation", "-w", dist, src],
        capture_output=True,
        text=True,
        env=env,
    )


def test_without_java_the_build_stops_with_one_line_saying_how(repo_root, tmp_path):
    src = clean_tree(repo_root, tmp_path / "src")
    env = {**os.environ, "JAVA_HOME": str(tmp_path / "no-java")}
    run = build_wheel(src, tmp_path / "dist", env)
    assert run.returncode != 0
    said = [line for line in (run.stdout + run.stderr).splitlines() if "needs Java 17" in line]
    assert len(said) == 1 and "openjdk-17-jdk-headless" in said[0], run.stderr[-3000:]
    assert not list((tmp_path / "dist").glob("*.whl"))


@pytest.fixture(scope="module")
def built(repo_root, tmp_path_factory):
    """``(wheel, sdist)`` built from a clean tree that sees this checkout's line environments."""
    missing = [line for line in SPARK_LINES if not line_python(repo_root, line).is_file()]
    if missing:
        pytest.skip(
            f"no .venv-spark/ for Spark {', '.join(missing)}: a wheel builds every line's "
            "jar with that line's pyspark ('./dev jars' makes them)"
        )
    tmp = tmp_path_factory.mktemp("wheel")
    src = clean_tree(repo_root, tmp / "src")
    (src / ".venv-spark").symlink_to(repo_root / ".venv-spark")
    run = build_wheel(src, tmp / "dist")
    assert run.returncode == 0, run.stderr[-4000:]
    (wheel,) = (tmp / "dist").glob("pyspark_safetensors-*.whl")
    # what `python -m build --sdist` calls
    subprocess.run(
        [sys.executable, "-c", "from setuptools import build_meta as b; b.build_sdist('sdist')"],
        cwd=src,
        check=True,
        capture_output=True,
    )
    (sdist,) = (src / "sdist").glob("pyspark_safetensors-*.tar.gz")
    return wheel, sdist


def test_the_wheel_has_every_lines_jar_built_for_that_line(built):
    wheel, _ = built
    with zipfile.ZipFile(wheel) as z:
        jars = sorted(n for n in z.namelist() if n.endswith(".jar"))
        assert jars == sorted(f"{RESOURCES}/{shim_jar_name(line)}" for line in SPARK_LINES)
        for line, (release, _) in SPARK_LINES.items():
            with zipfile.ZipFile(z.open(f"{RESOURCES}/{shim_jar_name(line)}")) as jar:
                manifest = jar.read("META-INF/MANIFEST.MF").decode()
                assert f"Spark-Version: {release}\r\n" in manifest, (line, manifest)
                service = jar.read(SERVICE).decode()
                assert "io.github.pysparksafetensors.SafetensorsSource" in service
                classes = jar.namelist()
                assert "io/github/pysparksafetensors/SafetensorsExtensions.class" in classes
                assert "io/github/pysparksafetensors/SafetensorsSource.class" in classes


@pytest.mark.jvm
@pytest.mark.parametrize("line", sorted({min(SPARK_LINES), max(SPARK_LINES)}))
def test_the_wheels_jar_loads_on_its_own_line(built, repo_root, line, tmp_path):
    """A session of that line's pyspark with the jar from the wheel: its SQL functions and
    its data source answer."""
    wheel, _ = built
    with zipfile.ZipFile(wheel) as z:
        jar = Path(z.extract(f"{RESOURCES}/{shim_jar_name(line)}", tmp_path))
    python = line_python(repo_root, line)
    script = (
        "import pyspark\n"
        "from pyspark_safetensors.spark.register import register\n"
        "from pyspark_safetensors.spark.session import local_session\n"
        "from pyspark_safetensors.spark.shim import SHIM_EXTENSIONS, shim_loaded\n"
        "spark = local_session('local[1]', **{'spark.sql.extensions': SHIM_EXTENSIONS})\n"
        "assert shim_loaded(spark)\n"
        "row = spark.sql(\"SELECT st_to_array(arr_to_st(array(1.5f, 2.5f), 'F16')) AS x\").first()\n"
        "assert row.x == [1.5, 2.5], row\n"
        f"spark.range(4).selectExpr('array(cast(id AS float)) AS x').write.format('safetensors')"
        f".option('batch_size', 2).mode('overwrite').save({str(tmp_path / 'acts')!r})\n"
        "assert register(spark, check=False) == 'jvm'\n"
        "print(pyspark.__version__)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYSPARK_")}
    env.update(
        PYSPARK_SAFETENSORS_SHIM_JAR=str(jar),
        PYSPARK_PYTHON=str(python),
        PYSPARK_DRIVER_PYTHON=str(python),
        # the suite's quick JIT, without the class archive of another Spark install
        SPARK_SUBMIT_OPTS="-XX:TieredStopAtLevel=1 -XX:+UseSerialGC",
    )
    run = subprocess.run(
        [python, "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stdout.strip().splitlines()[-1] == SPARK_LINES[line][0]
    manifest = (tmp_path / "acts" / "dataset_manifest.json").read_text()
    assert "(JVM)" in manifest  # written by the jar's source


def test_the_sdist_has_every_jar_and_its_wheel_needs_no_java(built, tmp_path):
    _, sdist = built
    with tarfile.open(sdist) as tar:
        names = tar.getnames()
        (top,) = {n.split("/")[0] for n in names}
        for line in SPARK_LINES:
            assert f"{top}/jvm-shim/target/{shim_jar_name(line)}" in names
        assert f"{top}/jvm-shim/build.sh" in names
        tar.extractall(tmp_path, filter="data")
    env = {**os.environ, "JAVA_HOME": str(tmp_path / "no-java")}
    run = build_wheel(tmp_path / top, tmp_path / "dist", env)
    assert run.returncode == 0, run.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    with zipfile.ZipFile(wheel) as z:
        assert sum(n.endswith(".jar") for n in z.namelist()) == len(SPARK_LINES)


def test_installed_wheel_runs_the_readme_example(
    built, repo_root, tmp_path, python_without_package
):
    wheel, _ = built
    python = python_without_package(tmp_path / "env")
    subprocess.run(
        [python, "-m", "pip", "--disable-pip-version-check", "-q", "install", "--no-deps", wheel],
        check=True,
        capture_output=True,
    )

    work = tmp_path / "work"
    work.mkdir()
    expected = sorted(shim_jar_name(line) for line in SPARK_LINES)
    check = (
        "import pyspark_safetensors, site\n"
        "from pyspark_safetensors.spark.session import conf_file\n"
        "from pyspark_safetensors.functions import shim_jar\n"
        "assert pyspark_safetensors.__file__.startswith(site.getsitepackages()[0])\n"
        "assert str(conf_file('log4j2.properties')).startswith(site.getsitepackages()[0])\n"
        "from pyspark_safetensors.spark.shim import shim_jar_name, spark_line\n"
        "jars = {p.name: p for p in __import__('pathlib').Path(site.getsitepackages()[0]).rglob('*shim*.jar')}\n"
        f"assert sorted(jars) == {expected!r}, sorted(jars)\n"
        "assert shim_jar() == jars[shim_jar_name(spark_line())], (shim_jar(), jars)\n"
    )
    script = work / "example.py"
    script.write_text(check + first_spark_example((repo_root / "README.md").read_text()))
    # "Activated": the environment's bin first on PATH, no PYSPARK_PYTHON (Spark's workers
    # and its data source lookup run `python3` from PATH).
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYSPARK_")}
    env.update(
        PATH=f"{python.parent}{os.pathsep}{env['PATH']}", VIRTUAL_ENV=str(python.parent.parent)
    )
    proc = subprocess.run(
        [python, script], cwd=work, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (work / "data" / "acts" / "dataset_manifest.json").is_file()
