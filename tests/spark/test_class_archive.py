"""The JVM class archive: a driver started by ``local_session`` maps it, a user's own
class-data-sharing flags win, and without an archive nothing changes."""

import os
import subprocess
import sys
import textwrap

import pytest

from pyspark_safetensors.spark import class_archive
from pyspark_safetensors.spark.class_archive import archive_path, java_options, with_archive


def test_without_an_archive_the_options_are_the_users(tmp_path, monkeypatch):
    monkeypatch.setenv(class_archive.CACHE_ENV, str(tmp_path))
    assert not archive_path().exists()
    assert java_options() == ""
    assert with_archive("-Dx=1") == "-Dx=1"


def test_an_archive_goes_first_unless_the_user_set_up_sharing(tmp_path, monkeypatch):
    monkeypatch.setenv(class_archive.CACHE_ENV, str(tmp_path))
    path = archive_path()
    path.parent.mkdir(parents=True)
    path.write_bytes(b"")
    class_archive._stamp_path(path).write_text(class_archive._jars_stamp())
    assert class_archive.is_current()
    assert with_archive("-Dx=1").startswith(f"-XX:SharedArchiveFile={path} ")
    assert with_archive("-Dx=1").endswith(" -Dx=1")
    own = "-XX:SharedArchiveFile=/elsewhere.jsa"
    assert with_archive(own) == own
    assert with_archive("-Xshare:off") == "-Xshare:off"


def test_an_archive_of_other_jars_is_stale(tmp_path, monkeypatch):
    """A reinstalled Spark at the same path and version: the JVM would map nothing of it."""
    monkeypatch.setenv(class_archive.CACHE_ENV, str(tmp_path))
    path = archive_path()
    path.parent.mkdir(parents=True)
    path.write_bytes(b"")
    assert not class_archive.is_current()  # built by no set-up here: no stamp
    class_archive._stamp_path(path).write_text(class_archive._jars_stamp())
    jars = tmp_path / "spark" / "jars"
    jars.mkdir(parents=True)
    (jars / "spark-core.jar").write_bytes(b"x")
    monkeypatch.setenv("SPARK_HOME", str(tmp_path / "spark"))
    assert not class_archive.is_current(path)
    assert java_options(path) == ""


@pytest.mark.spark
def test_a_local_session_maps_the_archive_set_up_built(tmp_path):
    """The driver, and the executors of a local-cluster master, each a JVM of its own."""
    if not class_archive.is_current():
        pytest.skip("no current JVM class archive for this Spark install: ./dev set-up builds the "
                    "default line's (python -m pyspark_safetensors.spark.class_archive)")  # fmt: skip
    logging = f"-Xlog:class+load=info:file={tmp_path}/classes-%p.log"
    script = textwrap.dedent(f"""
        from pyspark_safetensors.spark.session import local_session
        spark = local_session("local-cluster[1,1,1024]", **{{
            "spark.driver.extraJavaOptions": "{logging}",
            "spark.executor.extraJavaOptions": "{logging}"}})
        assert spark.range(3, numPartitions=1).selectExpr("id + 1 AS x").count() == 3
        spark.stop()
    """)
    env = {k: v for k, v in os.environ.items() if k != "SPARK_SUBMIT_OPTS"}  # local_session's own
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=300,
                   capture_output=True)  # fmt: skip
    logs = sorted(tmp_path.glob("classes-*.log"))
    assert len(logs) == 2  # the driver's and the executor's
    for log in logs:
        # Spark's own classes (lambdas are generated as the JVM runs, never archived)
        loaded = [line for line in log.read_text().splitlines()
                  if " org.apache.spark." in line and "$$Lambda" not in line]  # fmt: skip
        assert loaded
        shared = [line for line in loaded if "shared objects file (top)" in line]
        # (an executor also loads its own backend's classes, which no driver loads)
        assert len(shared) > 0.85 * len(loaded), (log.name, len(shared), len(loaded))


def test_the_spark_modules_import_one_another_without_a_circle():
    """Lazy imports inside functions count: the session maps the archive, so the archive
    (its path, its flags, building it) never imports the session; the recording session,
    which needs both, is a program of its own."""
    import ast
    from pathlib import Path

    from pyspark_safetensors import spark

    package = Path(spark.__file__).parent
    graph = {}
    for path in package.glob("*.py"):
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
                imported.add(node.module.split(".")[0])
            elif isinstance(node, ast.ImportFrom) and node.level == 1:
                imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "pyspark_safetensors.spark."
            ):
                imported.add(node.module.split(".")[2])
        graph[path.stem] = imported & {p.stem for p in package.glob("*.py")}

    def circle_from(module, trail):
        for child in sorted(graph[module]):
            if child in trail:
                return [*trail[trail.index(child) :], child]
            if found := circle_from(child, [*trail, child]):
                return found
        return None

    assert "session" not in graph["class_archive"] and "class_archive" in graph["session"]
    for module in sorted(graph):
        assert circle_from(module, [module]) is None, circle_from(module, [module])
