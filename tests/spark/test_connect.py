"""The data source through Spark Connect (what Databricks serverless and thin clients use)."""

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.spark


def test_write_through_spark_connect(tmp_path):
    # A separate process: a Connect session must not share the JVM of the classic one.
    script = textwrap.dedent(
        f"""
        import os, sys
        os.environ["PYSPARK_PYTHON"] = sys.executable
        from pyspark.sql import SparkSession
        spark = SparkSession.builder.remote("local[2]").getOrCreate()
        assert type(spark).__module__.startswith("pyspark.sql.connect")
        df = spark.range(10).selectExpr("array(cast(id as float), cast(id as float)) as v", "cast(id as string) as k")
        df.select("v").write.format("safetensors").option("batch_size", 5).mode("overwrite").save({str(tmp_path / "b")!r})
        df.write.format("safetensors").option("name_col", "k").mode("overwrite").save({str(tmp_path / "k")!r})
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    batch = json.loads((tmp_path / "b" / "dataset_manifest.json").read_text())
    kv = json.loads((tmp_path / "k" / "dataset_manifest.json").read_text())
    assert batch["total_samples"] == 10 and batch["schema"]["v"]["sample_shape"] == [2]
    assert kv["total_samples"] == 10 and kv["mode"] == "kv"
