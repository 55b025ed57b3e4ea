"""``pyspark_safetensors.register``: explicit registration, and a clear message when Spark's
workers run a Python that cannot import the package."""

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from pyspark_safetensors.spark import daemon

pytestmark = pytest.mark.spark
OURS = daemon.__name__


def test_register_checks_the_workers_and_registers(spark, tmp_path):
    import pyspark_safetensors

    pyspark_safetensors.register(spark)
    df = spark.range(3).selectExpr("array(cast(id AS float)) AS a")
    df.write.format("safetensors").option("batch_size", 2).mode("overwrite").save(str(tmp_path))
    assert json.loads((tmp_path / "dataset_manifest.json").read_text())["total_samples"] == 3


@pytest.mark.python_source
def test_wrong_worker_python_gets_a_message_naming_it(tmp_path, python_without_package):
    # A separate process: the worker interpreter is fixed when a SparkContext starts.
    wrong = python_without_package(tmp_path / "env")
    script = textwrap.dedent(
        """
        import os, sys
        from pyspark.sql import SparkSession
        import pyspark_safetensors
        from pyspark_safetensors.spark.register import WorkerPythonError

        for python, daemon in zip(sys.argv[1::2], sys.argv[2::2]):
            os.environ["PYSPARK_PYTHON"] = python
            spark = (SparkSession.builder.master("local[1]")
                     .config("spark.python.daemon.module", daemon).getOrCreate())
            try:
                pyspark_safetensors.register(spark)
                print("registered")
            except WorkerPythonError as e:
                print(e)
            spark.stop()
        """
    )
    missing = str(tmp_path / "no-such-python")
    env = {k: v for k, v in os.environ.items() if k != "PYSPARK_DRIVER_PYTHON"}
    proc = subprocess.run(
        # Spark's daemon, the package's (local_session's default: it fails to start where the
        # package is missing), and no python at all
        [
            sys.executable,
            "-c",
            script,
            str(wrong),
            "pyspark.daemon",
            str(wrong),
            OURS,
            missing,
            "pyspark.daemon",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 3, proc.stdout
    # Spark 4.0's worker fails on its own import of the package, before the probe runs
    for line in lines[:2]:
        assert re.match(
            re.escape(f"Spark's workers run {wrong}, which cannot import pyspark_safetensors: ")
            + r"(its Python worker failed \()?ModuleNotFoundError: No module named "
            + r"'pyspark_safetensors'",
            line,
        ), line
    assert lines[2].startswith(
        f"Spark's workers run {missing}, which cannot import pyspark_safetensors: its Python "
        f'worker failed (Cannot run program "{missing}"'
    ), lines[2]
    assert all("PYSPARK_PYTHON" in line for line in lines)
