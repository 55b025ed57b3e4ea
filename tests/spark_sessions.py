"""Spark sessions shared by the whole test run: one per configuration, started when a
module first asks for it and kept until a module asks for another (a process holds one
SparkContext at a time) or the run ends. Starting a JVM costs seconds; most modules share
the plain local one."""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

from pyspark_safetensors.spark.shim import SHIM_EXTENSIONS

CONFIGURATIONS: dict[str, tuple[str, dict[str, str]]] = {
    # a task fails at its first error (the retry tests use "cluster")
    "local": ("local[2]", {}),
    # the JVM shim's SQL functions enabled
    "shim": ("local[2]", {"spark.sql.extensions": SHIM_EXTENSIONS}),
    # executors in separate JVMs, each with its own Python workers, started with the
    # drivers' Java options (conftest's SPARK_SUBMIT_OPTS: the JIT's first tier, the serial
    # collector, the class archive), which reach no executor by themselves: 4-5 s less
    "cluster": (
        "local-cluster[2,1,1024]",
        {
            "spark.task.maxFailures": "2",
            "spark.executor.extraJavaOptions": os.environ.get("SPARK_SUBMIT_OPTS", ""),
        },
    ),
    # catalog tables in a Hive metastore (embedded Derby) with the shim's functions
    "hive": (
        "local[2]",
        {"spark.sql.catalogImplementation": "hive", "spark.sql.extensions": SHIM_EXTENSIONS},
    ),
}

_current: dict[str, object] = {}
_catalog_dirs: list[str] = []


def connect_server_in_pyspark() -> bool:
    """Whether the installed pyspark ships the Spark Connect server (4.0 and newer; 3.5's
    wheel has only the client, the server being a separate package there)."""
    from pathlib import Path

    import pyspark

    return any((Path(pyspark.__file__).parent / "jars").glob("spark-connect_*.jar"))


def spark_session(name: str = "local"):
    """The shared session of configuration ``name`` (see ``CONFIGURATIONS``); the session
    of another configuration is stopped first."""
    from pyspark_safetensors.spark.session import local_session

    if name in _current:
        return _current[name]
    stop_all()
    master, conf = CONFIGURATIONS[name]
    # catalog tables, a Hive metastore and its log go to a directory of the session's own,
    # never the working directory
    catalog = tempfile.mkdtemp(prefix="spark-catalog-")
    _catalog_dirs.append(catalog)
    session = local_session(
        master,
        app_name=f"pyspark-safetensors-tests-{name}",
        **{
            "spark.ui.showConsoleProgress": "false",
            "spark.sql.warehouse.dir": f"{catalog}/warehouse",
            "spark.hadoop.javax.jdo.option.ConnectionURL": (
                f"jdbc:derby:;databaseName={catalog}/metastore_db;create=true"
            ),
            "spark.driver.extraJavaOptions": f"-Dderby.stream.error.file={catalog}/derby.log",
            **conf,
        },
    )
    _current[name] = session
    return session


class Unstopped:
    """A shared session handed to code that stops the session it starts (the CLI, the
    pipeline's stages): ``stop`` does nothing, everything else is the session's."""

    def __init__(self, spark):
        self._spark = spark

    def __getattr__(self, name):
        return getattr(self._spark, name)

    def stop(self):
        pass


def stop_all() -> None:
    """Stop the shared session, if one runs, and remove its catalog directory."""
    while _current:
        _, session = _current.popitem()
        session.stop()
    while _catalog_dirs:
        shutil.rmtree(_catalog_dirs.pop(), ignore_errors=True)


atexit.register(stop_all)


@contextlib.contextmanager
def connect_server(env: dict[str, str] | None = None, *, timeout: float = 180):
    """A Spark Connect server as it is deployed: its own process, started from the
    installed pyspark (``bin/spark-submit --class ...SparkConnectServer``, which every 4.x
    line has) with the shim jar and its extension, bound to loopback on a free port.
    Yields ``sc://127.0.0.1:PORT``; stops the server by its process id."""
    from pathlib import Path

    import pyspark

    from pyspark_safetensors.spark.shim import SHIM_EXTENSIONS, shim_jar

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    home = Path(pyspark.__file__).parent
    command = [
        str(home / "bin" / "spark-submit"),
        "--class", "org.apache.spark.sql.connect.service.SparkConnectServer",
        "--master", "local[2]",
        "--jars", str(shim_jar()),
        "--conf", f"spark.sql.extensions={SHIM_EXTENSIONS}",
        "--conf", "spark.connect.grpc.binding.address=127.0.0.1",
        "--conf", f"spark.connect.grpc.binding.port={port}",
        "--conf", "spark.ui.enabled=false",
    ]  # fmt: skip
    environment = {**os.environ, "PYSPARK_PYTHON": sys.executable, "SPARK_HOME": str(home)}
    # its log goes to a file: a pipe nobody reads fills up and blocks the server; it runs
    # in a directory of its own, where its spark-warehouse/ and metastore land
    with tempfile.TemporaryFile() as log, tempfile.TemporaryDirectory(prefix="connect-") as cwd:
        server = subprocess.Popen(
            command,
            env={**environment, **(env or {})},
            cwd=cwd,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + timeout
            while True:
                if server.poll() is not None:
                    log.seek(0)
                    raise RuntimeError(f"the Connect server exited: {log.read()[-3000:]!r}")
                with socket.socket() as s:
                    if s.connect_ex(("127.0.0.1", port)) == 0:
                        break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no Connect server on port {port} after {timeout} s")
                time.sleep(0.5)
            yield f"sc://127.0.0.1:{port}"
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, 15)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, 9)
                server.wait()
