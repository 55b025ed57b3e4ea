"""Writes through the data source's writer without Spark (the driver's and the tasks'
calls made by hand), shared by the commit and generation tests."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from pyspark.sql.types import ArrayType, FloatType, LongType, StringType, StructField, StructType

from pyspark_safetensors.spark.source import SafetensorsDataSource

SCHEMA = StructType(
    [
        StructField("key", StringType()),
        StructField("id", LongType()),
        StructField("vec", ArrayType(FloatType())),
    ]
)


def batch(start, n):
    """Rows ``start .. start + n - 1``: key ``k{i}``, id ``i``, vec ``[i, i + 0.5]``."""
    ids = np.arange(start, start + n)
    vec = pa.array([[float(i), float(i) + 0.5] for i in ids], pa.list_(pa.float32()))
    keys = pa.array([f"k{i}" for i in ids])
    return pa.record_batch([keys, pa.array(ids), vec], names=["key", "id", "vec"])


def writer(path, overwrite=False, **options):
    """The source's writer of ``id, vec`` (batches of 4 unless KV options are given)."""
    mode = {"batch_size": "4"} if "name_col" not in options else {}
    opts = {"path": str(path), "columns": "id,vec", **mode, **options}
    return SafetensorsDataSource(opts).writer(SCHEMA, overwrite)


def files(root):
    """Every file under ``root``, relative, sorted."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
