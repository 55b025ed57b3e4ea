"""Which implementation answers ``format("safetensors")``: the JVM source where the shim jar
is on the classpath, the Python source where it is not or where a path's scheme has no
Hadoop ``FileSystem``; the option and the session conf ``implementation`` force either."""

import json
from pathlib import Path

import pytest
from pyspark.sql import functions as F

from implementations import require
from pyspark_safetensors.spark.options import IMPLEMENTATION_CONF, OptionError, WriterOptions
from pyspark_safetensors.spark.register import implementation, register

pytestmark = [pytest.mark.spark, pytest.mark.python_source]


def frame(spark):
    return spark.range(6, numPartitions=1).select(
        F.array(F.col("id").cast("float"), F.lit(1.0).cast("float")).alias("x")
    )


def created_by(path) -> str:
    return json.loads((Path(path) / "dataset_manifest.json").read_text())["created_by"]


def save(df, path, **options):
    df.write.format("safetensors").options(batch_size="4", **options).mode("overwrite").save(
        str(path)
    )


@pytest.fixture
def conf(spark):
    """The session's implementation conf, restored after the test."""
    before = spark.conf.get(IMPLEMENTATION_CONF, None)
    yield lambda value: spark.conf.set(IMPLEMENTATION_CONF, value)
    if before is None:
        spark.conf.unset(IMPLEMENTATION_CONF)
    else:
        spark.conf.set(IMPLEMENTATION_CONF, before)


def test_the_jar_makes_the_jvm_source_the_format(spark, tmp_path, conf):
    require(spark, "jvm")
    conf("auto")
    assert register(spark, check=False) == implementation(spark) == "jvm"
    save(frame(spark), tmp_path / "jvm")
    assert created_by(tmp_path / "jvm").endswith("(JVM)")
    save(frame(spark), tmp_path / "py", implementation="python")
    assert not created_by(tmp_path / "py").endswith("(JVM)")
    # each reads the other's dataset, whichever answers
    for path in ("jvm", "py"):
        for impl in ("python", "auto"):
            got = spark.read.format("safetensors").option("implementation", impl)
            assert got.load(str(tmp_path / path)).count() == 6


def test_the_session_conf_forces_the_python_source(spark, tmp_path, conf):
    require(spark, "jvm")
    conf("python")
    assert implementation(spark) == "python"
    save(frame(spark), tmp_path / "py")
    assert not created_by(tmp_path / "py").endswith("(JVM)")
    # the option outranks the conf
    save(frame(spark), tmp_path / "jvm", implementation="jvm")
    assert created_by(tmp_path / "jvm").endswith("(JVM)")


def test_an_unknown_implementation_is_refused(spark, tmp_path, conf):
    with pytest.raises(Exception, match=r"implementation.*'gpu' is not one of auto, jvm, python"):
        save(frame(spark), tmp_path / "x", implementation="gpu")
    if require(spark, "jvm"):
        conf("GPU")
        with pytest.raises(Exception, match=IMPLEMENTATION_CONF + r"='GPU' is not one of"):
            save(frame(spark), tmp_path / "y")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_the_python_source_refuses_jvm_saying_the_jar_is_missing():
    # reached only where no JVM source took the read or write
    with pytest.raises(OptionError, match=r"implementation=jvm.*with_shim"):
        WriterOptions.parse({"path": "x", "batch_size": "2", "implementation": "jvm"})


def test_a_path_without_a_hadoop_file_system_goes_to_the_python_source(
    spark, s3_bucket, s3_endpoint
):
    """``s3://`` has no Hadoop FileSystem in a plain Spark (no hadoop-aws): ``auto`` hands
    the write and the read to the Python source, which reaches the store through pyarrow;
    forcing the JVM gives Hadoop's refusal."""
    require(spark, "jvm")
    from pyspark_safetensors.dataset import DatasetLocation, load_manifest

    uri, store = f"{s3_bucket}/auto", {"endpoint_url": s3_endpoint}
    save(frame(spark), uri, **store)
    location = DatasetLocation.of(uri, storage_options=store)
    assert not load_manifest(location).created_by.endswith("(JVM)")
    assert spark.read.format("safetensors").options(**store).load(uri).count() == 6
    forced = spark.read.format("safetensors").options(implementation="jvm", **store)
    with pytest.raises(Exception, match=r'(?i)no filesystem for scheme "?s3'):
        forced.load(uri).count()
