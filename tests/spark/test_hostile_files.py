"""The hardening corpus through both Spark readers: every malformed file is refused by the
Python and the JVM reader alike, naming the file and the rule, and the JVM header check
accepts exactly the randomly mutated files the Python format layer accepts."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hostile_files import CORPUS, mutate
from implementations import IMPLEMENTATIONS, reader, require
from pyspark_safetensors.format import SafetensorsFormatError, read_header, write_shard

pytestmark = pytest.mark.spark


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("name,data,error", CORPUS, ids=[c[0] for c in CORPUS])
def test_both_readers_refuse_the_corpus(spark, tmp_path, implementation, name, data, error):
    require(spark, implementation)
    path = tmp_path / "bad.safetensors"
    path.write_bytes(data)
    with pytest.raises(Exception) as info:
        reader(spark, implementation).load(str(path)).collect()
    message = str(info.value)
    assert "bad.safetensors" in message and "rule:" in message, message[-2000:]


@pytest.fixture(scope="module")
def jvm_header(spark):
    """``check(path)``: the JVM reader's header check of a local file; raises on refusal."""
    require(spark, "jvm")
    jvm = spark._jvm
    conf = spark.sparkContext._jsc.hadoopConfiguration()

    def check(path):
        storage = jvm.io.github.pysparksafetensors.core.Storage.apply(str(path.parent), conf)
        jvm.io.github.pysparksafetensors.core.Header.read(storage, path.name, path.stat().st_size)

    return check


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_jvm_header_check_accepts_what_the_format_layer_accepts(tmp_path, jvm_header, data):
    valid = tmp_path / "valid.safetensors"
    if not valid.exists():
        tensors = {
            "a": np.arange(6, dtype=np.float32).reshape(2, 3),
            "b": np.arange(3, dtype=np.int8),
        }
        write_shard(valid, tensors, {"k": "v"})
    path = tmp_path / "mutant.safetensors"
    path.write_bytes(mutate(data, valid.read_bytes()))
    try:
        read_header(path)
        python = None
    except SafetensorsFormatError as e:
        python = str(e)
    try:
        jvm_header(path)
        jvm = None
    except Exception as e:  # py4j's wrapper of the JVM's refusal
        jvm = str(e)
        assert "mutant.safetensors" in jvm and "rule:" in jvm, jvm[-2000:]
    assert (python is None) == (jvm is None), f"python: {python}\njvm: {(jvm or '')[-1500:]}"
