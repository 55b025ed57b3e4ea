"""Spark SQL functions for Tensor Structs: ``arr_to_st``, ``st_to_array``, ``st_shape``,
``st_dtype``, ``st_numel``, and ``with_shim`` to load the JVM shim that runs them natively.
See :mod:`pyspark_safetensors.spark.functions`, :mod:`pyspark_safetensors.spark.shim` and ``docs/functions.md``."""

from .spark.functions import (
    TensorFunctionError,
    arr_to_st,
    st_dtype,
    st_numel,
    st_shape,
    st_to_array,
)
from .spark.shim import SHIM_EXTENSIONS, shim_jar, shim_loaded, with_shim

__all__ = [
    "SHIM_EXTENSIONS",
    "TensorFunctionError",
    "arr_to_st",
    "shim_jar",
    "shim_loaded",
    "st_dtype",
    "st_numel",
    "st_shape",
    "st_to_array",
    "with_shim",
]
