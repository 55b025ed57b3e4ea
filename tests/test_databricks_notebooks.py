"""The notebooks of ``examples/databricks/`` run as Databricks runs them: every notebook,
cell by cell, in order, on a local session. Python cells run as Python (``spark`` the
session, ``dbutils`` a stand-in whose widgets answer a temporary directory), ``%sql``
cells statement by statement through ``spark.sql``, ``%pip`` and ``%md`` cells are
skipped. Twice: without the jar, as on serverless, where the Python source answers
``format("safetensors")`` (the session's implementation conf says ``python``: a JVM
cannot drop a jar from its class path once started), and with the jar and its extension
(the JVM source, which also makes the catalog table)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.spark

NOTEBOOKS = sorted((Path(__file__).parent.parent / "examples" / "databricks").glob("*.py"))
HEADER = "# Databricks notebook source"
SEPARATOR = "\n# COMMAND ----------\n"
MAGIC = "# MAGIC"


def cells(path: Path) -> list[tuple[str, str]]:
    """``(kind, source)`` of each cell of a notebook in Databricks' source format: kind
    ``python``, or a magic cell's command (``md``, ``sql``, ``pip``) with its lines."""
    text = path.read_text()
    assert text.startswith(HEADER + "\n"), f"{path.name} does not start with {HEADER!r}"
    found = []
    for cell in text[len(HEADER) + 1 :].split(SEPARATOR):
        lines = [line for line in cell.strip("\n").splitlines() if line.strip()]
        if lines and all(line.startswith(MAGIC) for line in lines):
            body = "\n".join(line[len(MAGIC) + 1 :] for line in cell.strip("\n").splitlines())
            command, _, rest = body.partition("\n")
            kind, _, first = command.strip().partition(" ")
            assert kind.startswith("%"), f"{path.name}: a MAGIC cell without a %command"
            found.append((kind[1:], f"{first}\n{rest}".strip()))
        else:
            assert not any(line.startswith(MAGIC) for line in lines), (
                f"{path.name}: a cell mixes Python and MAGIC lines"
            )
            found.append(("python", cell.strip("\n")))
    return found


class Widgets:
    """``dbutils.widgets`` as a notebook uses it: ``text`` declares a widget with its
    default, ``get`` answers the value set for the run (the default where none is)."""

    def __init__(self, values: dict[str, str]):
        self.values, self.defaults = values, {}

    def text(self, name: str, defaultValue: str, label: str | None = None) -> None:
        self.defaults[name] = defaultValue

    def get(self, name: str) -> str:
        if name not in self.defaults:  # as Databricks: InputWidgetNotDefined
            raise KeyError(f"no widget named {name!r}")
        return self.values.get(name, self.defaults[name])


class DBUtils:
    def __init__(self, widgets: dict[str, str]):
        self.widgets = Widgets(widgets)


def run_notebook(path: Path, spark, dbutils) -> tuple[dict, list[list]]:
    """Run the notebook's cells in order; its Python namespace and each SQL cell's rows
    (those of its last statement)."""
    namespace = {"spark": spark, "dbutils": dbutils, "__name__": "__main__"}
    sql_results = []
    for index, (kind, source) in enumerate(cells(path)):
        if kind == "python":
            exec(compile(source, f"{path.name}[cell {index}]", "exec"), namespace)
        elif kind == "sql":
            statements = [s.strip() for s in source.split(";") if s.strip()]
            sql_results.append([spark.sql(s).collect() for s in statements][-1])
        else:
            assert kind in ("md", "pip"), f"{path.name}: unknown cell %{kind}"
            if kind == "pip":
                assert source.startswith("install pyspark-safetensors"), source
    return namespace, sql_results


@pytest.fixture(autouse=True)
def headless_plots():
    """Figures drawn off screen (``plt.show()`` shows nothing, saying so in a warning)."""
    import matplotlib

    matplotlib.use("Agg")
    yield
    import matplotlib.pyplot as plt

    plt.close("all")


def test_the_notebooks_are_databricks_source_with_a_volumes_widget():
    assert [p.name for p in NOTEBOOKS] == [
        "01_write_and_query_activations.py",
        "02_train_sae.py",
    ]
    for path in NOTEBOOKS:
        kinds = [kind for kind, _ in cells(path)]
        assert kinds[0] == "md" and "pip" in kinds, (path.name, kinds)
        assert 'dbutils.widgets.text("root", "/Volumes/' in path.read_text()
    assert "sql" in [kind for kind, _ in cells(NOTEBOOKS[0])]


@pytest.mark.filterwarnings("ignore:FigureCanvasAgg is non-interactive")
@pytest.mark.parametrize(
    "jar", [pytest.param(False, marks=pytest.mark.python_source, id="no-jar"),
            pytest.param(True, marks=pytest.mark.jvm, id="jar")],
)  # fmt: skip
def test_the_notebooks_run_cell_by_cell(jar, tmp_path):
    from pyspark_safetensors.spark.options import IMPLEMENTATION_CONF
    from pyspark_safetensors.spark.shim import shim_loaded
    from spark_sessions import spark_session

    spark = spark_session("shim" if jar else "local")
    if jar and not shim_loaded(spark):
        pytest.skip("no shim jar for this Spark line (jvm-shim/build.sh builds it)")
    previous = spark.conf.get(IMPLEMENTATION_CONF, None)
    if not jar:
        spark.conf.set(IMPLEMENTATION_CONF, "python")
    dbutils = DBUtils({"root": str(tmp_path)})
    try:
        written, sql = run_notebook(NOTEBOOKS[0], spark, dbutils)
        trained, _ = run_notebook(NOTEBOOKS[1], spark, dbutils)
    finally:
        if previous is None:
            spark.conf.unset(IMPLEMENTATION_CONF)
        else:
            spark.conf.set(IMPLEMENTATION_CONF, previous)
        for view in ("acts", "token_norms"):
            spark.catalog.dropTempView(view)
        spark.sql("DROP TABLE IF EXISTS safetensors_acts")

    assert dbutils.widgets.defaults["root"].startswith("/Volumes/")
    assert written["implementation"] == ("jvm" if jar else "python")
    assert written["catalog_table"] == ("safetensors_acts" if jar else None)
    manifest = json.loads((tmp_path / "acts" / "dataset_manifest.json").read_text())
    assert manifest["total_samples"] == 4096
    assert manifest["created_by"].endswith("(JVM)") == jar
    (tokens, texts, d_model) = sql[0][0]
    assert (tokens, texts, d_model) == (4096, 256, 32)
    assert [row.token_pos for row in sql[1]] == [0, 1, 2, 3]
    assert trained["metrics"]["fvu"] < 0.9  # it learnt: 0.59 after its 64 steps
    for name in ("sae.safetensors", "training.png", "latent_frequency.png"):
        assert (tmp_path / "sae" / name).is_file(), name
    assert tuple(trained["indices"].shape) == (8, 4)
