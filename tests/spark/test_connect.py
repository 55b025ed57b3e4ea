"""The data source through Spark Connect (what Databricks serverless and thin clients use)."""

import json
import subprocess
import sys
import textwrap

import pytest
from pyspark.sql import functions as F

from spark_sessions import connect_server_in_pyspark

ARROW_UDFS = hasattr(F, "arrow_udf")  # the tensor functions' fallback (Spark 4.1+)

pytestmark = [
    pytest.mark.spark,
    pytest.mark.skipif(
        not connect_server_in_pyspark(), reason="this pyspark ships no Spark Connect server"
    ),
]


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


@pytest.mark.jvm
def test_a_separate_connect_server_writes_reads_and_runs_the_tensor_functions(
    tmp_path, connect_server_url
):
    # The server as it is deployed: its own process from the installed pyspark, with the
    # jar and its extension; the client in another process, on loopback.
    url, _ = connect_server_url
    script = textwrap.dedent(
        f"""
        import sys
        from pyspark.sql import SparkSession
        from pyspark_safetensors.functions import arr_to_st, shim_loaded, st_to_array
        spark = SparkSession.builder.remote({url!r}).getOrCreate()
        assert type(spark).__module__.startswith("pyspark.sql.connect")
        assert shim_loaded(spark)
        df = spark.range(4).selectExpr("array(cast(id as float), 0.1f) AS x", "cast(id as string) AS k")
        got = {{}}
        for jvm in (True, False) if {ARROW_UDFS!r} else (True,):
            t = df.select(arr_to_st("x", [2], "F16", jvm=jvm).alias("t"))
            got[jvm] = [(bytes(r.t.data), list(r.a)) for r in t.select("t", st_to_array("t", jvm=jvm).alias("a")).collect()]
        assert got[True] == got.get(False, got[True]), got
        assert got[True][1][1] == [1.0, 0.0999755859375], got
        df.select("x").write.format("safetensors").option("batch_size", 2).mode("overwrite").save({str(tmp_path / "b")!r})
        df.write.format("safetensors").option("name_col", "k").mode("overwrite").save({str(tmp_path / "k")!r})
        back = spark.read.format("safetensors").load({str(tmp_path / "b")!r})
        assert sorted(r.x[0] for r in back.collect()) == [0.0, 1.0, 2.0, 3.0]
        assert spark.read.format("safetensors").load({str(tmp_path / "k")!r}).count() == 4
        print("ok")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]
    kv = json.loads((tmp_path / "k" / "dataset_manifest.json").read_text())
    assert kv["total_samples"] == 4 and kv["mode"] == "kv"
