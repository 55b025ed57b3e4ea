"""Shared fixtures. Tiers are pytest markers (see pyproject): unit, spark, distributed,
integration, jvm. Spark sessions are shared by the whole run (``tests/spark_sessions.py``)."""

from __future__ import annotations

import os
import sys
import venv
from pathlib import Path

# Before anything loads torch or numpy: every process of the run (xdist workers, Spark's
# Python workers, torchrun's) takes one code path of the numeric libraries, so a trained
# figure is the same bits on any x86-64 CPU with AVX2 (``tests/cpu_path.py``).
from cpu_path import pin

pin()

import pytest  # noqa: E402

from pyspark_safetensors.spark.class_archive import with_archive  # noqa: E402

REPO = Path(__file__).resolve().parent.parent

# The suite starts dozens of short-lived Spark drivers (shared sessions, CLI runs, pages,
# a Connect server) on tiny data, two at a time on two cores: the JIT's first tier alone
# and the serial collector start them with less CPU (a small features job ran in 39 s
# instead of 47 s). spark-submit passes SPARK_SUBMIT_OPTS to every driver it launches,
# ours and the subprocesses'; the benchmarks keep the JVM's defaults. Each driver also maps
# the class archive set-up built (``spark.class_archive``), as ``local_session`` does:
# about 6 s less per driver, whichever way the test starts it.
os.environ.setdefault("SPARK_SUBMIT_OPTS", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")
os.environ["SPARK_SUBMIT_OPTS"] = with_archive(os.environ["SPARK_SUBMIT_OPTS"])

# Toy models (``extract.toy_lm``, ``toy_vit``) are trained once per run, by the first
# process asking for one, into a directory every later one copies it from: the xdist
# workers, the documentation pages and the pipelines' CLI runs inherit the variable set
# here, in the run's first process, which removes the directory at the end.
_TOY_CACHE = None
if "PYTEST_XDIST_WORKER" not in os.environ and "PYSPARK_SAFETENSORS_TOY_CACHE" not in os.environ:
    import tempfile

    _TOY_CACHE = os.environ["PYSPARK_SAFETENSORS_TOY_CACHE"] = tempfile.mkdtemp(prefix="toys-")


def pytest_unconfigure(config):
    if _TOY_CACHE is not None:
        import shutil

        shutil.rmtree(_TOY_CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


# What varies between machines, and so between runs of a figure that comes out of
# training, set by ``tests/margins.py`` when it measures each such figure's spread (unset,
# a run is the suite's usual one): torch's threads in the test processes (and, through
# OMP_NUM_THREADS, in the Spark workers and torchrun processes they start),
# deterministic kernels, and the seed the ``seed`` fixture hands the trained tests. The
# CPU's own kernels instead of the pinned path above are PSS_TEST_NATIVE_KERNELS=1.
THREADS = os.environ.get("PSS_TEST_THREADS", "")
if THREADS:
    os.environ["OMP_NUM_THREADS"] = THREADS
if THREADS or os.environ.get("PSS_TEST_DETERMINISTIC"):
    import torch

    if THREADS:
        torch.set_num_threads(int(THREADS))
    torch.use_deterministic_algorithms(bool(os.environ.get("PSS_TEST_DETERMINISTIC")))


@pytest.fixture(scope="session")
def seed() -> int:
    """The seed of a trained test's data, model and training run: 0, or what
    ``tests/margins.py`` sets to measure the spread over seeds."""
    return int(os.environ.get("PSS_TEST_SEED", "0"))


@pytest.fixture
def figure(record_property):
    """``figure(name, value, above=..., below=...)``: assert a trained figure against its
    threshold and record both (``tests/margins.py`` reads them from the JUnit report).
    ``timed=True``: the figure depends on timing (which rows a follower saw when), so the
    run's fingerprint leaves it out."""

    def check(name: str, value: float, *, above: float | None = None,
              below: float | None = None, context: object = "", timed: bool = False) -> None:  # fmt: skip
        value = float(value)
        record_property(f"figure:{name}", repr(value))
        if timed:
            record_property(f"timed:{name}", "true")
        bound = (">", above) if above is not None else ("<", below)
        record_property(f"threshold:{name}", f"{bound[0]} {bound[1]!r}")
        if above is not None:
            assert value > above, f"{name} = {value:.4f}, must be > {above} {context}"
        if below is not None:
            assert value < below, f"{name} = {value:.4f}, must be < {below} {context}"

    return check


# Under pytest-xdist (`./dev test` runs two workers) each module's tests go to one worker,
# where its module fixtures (Spark datasets, a trained SAE) are built once; each
# documentation page's blocks run in a fresh process of their own and share nothing, so
# the pages are spread one by one. The longest units (the pages, the end-to-end pipeline)
# start first, so the two workers finish together instead of one running them alone at
# the end. (xdist's own `loadgroup` cannot be used: it renames tests in a way pytest 9 no
# longer reads.)
_SPLIT_BY_TEST = {"tests/test_docs.py"}
# Modules handed out together, to one worker: they share a session fixture
_SHARED_SCOPES = {  # one Spark Connect server (`connect_server_url`)
    "tests/spark/test_connect.py": "spark-connect",
    "tests/extract/test_extract_connect.py": "spark-connect",
    # one graph job (tests/graphs/conftest.py `graph_job`, half a minute) for all three
    "tests/graphs/test_export.py": "graph-job",
    "tests/graphs/test_global_weights.py": "graph-job",
    "tests/graphs/test_neuronpedia.py": "graph-job",
}
_LONGEST_FIRST = {"tests/test_docs.py", "tests/test_pipeline.py"}


def pytest_collection_modifyitems(config, items):
    # Tests with no tier marker are unit tests.
    tiers = {"spark", "distributed", "integration", "jvm"}
    # Spark 3.5 has no Python data sources: what runs on the Python source is skipped
    # there, the JVM source's twin of each test still runs.
    from pyspark_safetensors.spark.compat import spark_major
    from pyspark_safetensors.spark.register import python_data_sources

    no_python_source = None if python_data_sources() else _skip_on_this_spark("Python data sources")
    no_arrow_udf = None if _arrow_udfs() else _skip_on_this_spark("Arrow UDFs")
    # Spark 3.5's session catalog resolves tables of its V1 source API only
    no_catalog_tables = (
        None
        if spark_major() >= 4
        else _skip_on_this_spark("catalog tables of DataSource V2 sources")
    )
    for item in items:
        if not any(m.name in tiers for m in item.iter_markers()):
            item.add_marker(pytest.mark.unit)
        if no_python_source is not None and _runs_the_python_source(item):
            item.add_marker(no_python_source)
        if no_arrow_udf is not None and list(item.iter_markers("arrow_udf")):
            item.add_marker(no_arrow_udf)
        if no_catalog_tables is not None and list(item.iter_markers("catalog_tables")):
            item.add_marker(no_catalog_tables)
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in _LONGEST_FIRST)


def _arrow_udfs() -> bool:
    from pyspark.sql import functions as F

    return hasattr(F, "arrow_udf")


def _skip_on_this_spark(missing: str):
    import pyspark

    return pytest.mark.skip(reason=f"Spark {pyspark.__version__} has no {missing}")


def _runs_the_python_source(item) -> bool:
    """Parametrised with the Python implementation, or marked ``python_source``."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    return "python" in params.values() or bool(list(item.iter_markers("python_source")))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        """xdist's scope scheduling with a module as the scope (a page of the docs for
        the docs test; modules that share a fixture together), scopes handed out in
        collection order."""

        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::")[0]
            return nodeid if module in _SPLIT_BY_TEST else _SHARED_SCOPES.get(module, module)

    config.option.loadscopereorder = False  # keep the longest-first order
    return ByModule(config, log)


os.environ.setdefault("PYARROW_IGNORE_TIMEZONE", "1")

# The loopback S3 server's credentials, set before any Spark JVM starts so that every Python
# worker (executors of local-cluster masters included) inherits them; tests pass the
# endpoint themselves, so no real store is ever reached.
os.environ.update(
    AWS_ACCESS_KEY_ID="testing",
    AWS_SECRET_ACCESS_KEY="testing",
    AWS_REGION="us-east-1",
    AWS_EC2_METADATA_DISABLED="true",
)


@pytest.fixture(scope="session")
def python_without_package():
    """A function making a virtual environment at ``dest`` with every package of this one
    except pyspark_safetensors (symlinked, so it costs nothing) and returning its python:
    pyspark and pyarrow import there, this package does not until it is installed."""

    def make(dest: Path) -> Path:
        venv.EnvBuilder(with_pip=False).create(dest)
        (target,) = (dest / "lib").glob("python3*/site-packages")
        # every site-packages on the path: a Spark line's environment adds .venv's by a .pth
        for packages in {Path(p) for p in sys.path if p.endswith("site-packages")}:
            for entry in packages.iterdir():
                name = entry.name.lower().replace("-", "_")
                if "pyspark_safetensors" in name or (target / entry.name).exists():
                    continue
                (target / entry.name).symlink_to(entry)
        return dest / "bin" / "python"

    return make


@pytest.fixture(scope="session")
def s3_endpoint():
    """A standalone S3 server (moto) on a free loopback port for the whole session."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture(scope="session")
def connect_server_url(tmp_path_factory):
    """``(url, hub settings)``: a Spark Connect server as it is deployed (its own process,
    ``spark_sessions.connect_server``), shared by the Connect tests; the workers it starts
    load Hugging Face models offline from the hub cache the settings name (empty until a
    test fills it). It runs until the worker's session ends: idle, it holds memory, not
    CPU."""
    from spark_sessions import connect_server

    hub = {"HF_HUB_CACHE": str(tmp_path_factory.mktemp("connect-hub")), "HF_HUB_OFFLINE": "1"}
    with connect_server(env=hub) as url:
        yield url, hub


@pytest.fixture
def s3_bucket(s3_endpoint, request) -> str:
    """A fresh bucket on the loopback S3 server; returns its ``s3://`` URI."""
    import re
    import uuid

    import pyarrow.fs as pafs

    name = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:40].strip("-")
    name = f"{name}-{uuid.uuid4().hex[:8]}"
    scheme, _, host = s3_endpoint.partition("://")
    pafs.S3FileSystem(endpoint_override=host, scheme=scheme, allow_bucket_creation=True).create_dir(
        name
    )
    return f"s3://{name}"


@pytest.fixture(scope="module")
def spark():
    """The run's shared local Spark session (local[2]; a task fails at its first error),
    from ``tests/spark_sessions.py``."""
    from spark_sessions import spark_session

    return spark_session("local")


def pytest_sessionfinish(session, exitstatus):
    from spark_sessions import stop_all

    stop_all()
