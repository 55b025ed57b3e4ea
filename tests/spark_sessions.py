"""Spark sessions shared by the whole test run: one per configuration, started when a
module first asks for it and kept until a module asks for another (a process holds one
SparkContext at a time) or the run ends. Starting a JVM costs seconds; most modules share
the plain local one."""

from __future__ import annotations

import atexit

from pyspark_safetensors.spark.shim import SHIM_EXTENSIONS

CONFIGURATIONS: dict[str, tuple[str, dict[str, str]]] = {
    # task retries (local[2, 4]): the retry tests need them
    "local": ("local[2, 4]", {}),
    # the JVM shim's SQL functions enabled
    "shim": ("local[2]", {"spark.sql.extensions": SHIM_EXTENSIONS}),
    # executors in separate JVMs, each with its own Python workers
    "cluster": ("local-cluster[2,1,1024]", {"spark.task.maxFailures": "2"}),
}

_current: dict[str, object] = {}


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
    session = local_session(
        master,
        app_name=f"pyspark-safetensors-tests-{name}",
        **{"spark.ui.showConsoleProgress": "false", **conf},
    )
    _current[name] = session
    return session


def stop_all() -> None:
    """Stop the shared session, if one runs."""
    while _current:
        _, session = _current.popitem()
        session.stop()


atexit.register(stop_all)
