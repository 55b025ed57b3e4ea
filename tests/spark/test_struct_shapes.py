"""The Tensor Struct's shape is array<int>: dimensions beyond it are refused by name."""

import numpy as np
import pytest

pytest.importorskip("pyspark.sql.datasource", reason="this Spark has no Python data sources")


from pyspark_safetensors.format import read_header, write_shard
from pyspark_safetensors.spark.reader import ReadError, _struct_rows, _tensor_struct

pytestmark = pytest.mark.unit


def test_dimensions_beyond_int32_are_refused_with_the_tensor_named(tmp_path):
    path = tmp_path / "huge.safetensors"
    write_shard(path, {"k1__x": np.empty((0, 2**33), np.float32)})
    (info,) = read_header(path).tensors
    with pytest.raises(ReadError, match=r"'k1__x'.*above 2\^31 - 1.*view=tensors"):
        _tensor_struct(memoryview(b""), info)
    with pytest.raises(ReadError, match="above 2"):
        _struct_rows(np.empty((3, 0, 2**33), np.float32), "F32")


def test_ordinary_shapes_pass_through(tmp_path):
    path = tmp_path / "ok.safetensors"
    write_shard(path, {"t": np.zeros((2, 3), np.float32)})
    (info,) = read_header(path).tensors
    assert _tensor_struct(memoryview(b"\0" * 24), info)["shape"] == [2, 3]
    rows = _struct_rows(np.zeros((4, 2, 3), np.float32), "F32")
    assert rows.field("shape").to_pylist() == [[2, 3]] * 4
