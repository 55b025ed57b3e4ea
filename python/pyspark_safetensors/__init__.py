"""pyspark-safetensors: safetensors datasets from Apache Spark to torch SAE training.

``df.write.format("safetensors")`` works with no registration call when Spark's Python
can import this package: Spark imports every ``pyspark_*`` module at session start and
registers its ``DefaultSource``. Importing this package is therefore kept cheap; heavy
layers (Spark, torch) load on first use. ``register(spark)`` registers the source
explicitly and checks that Spark's workers can import the package.
``PysparkSafetensorsError`` is the base of every error raised for a user.
"""

from ._version import __version__

__all__ = ["DefaultSource", "PysparkSafetensorsError", "__version__", "register"]


def __getattr__(name):
    if name == "DefaultSource":
        from .spark.source import SafetensorsDataSource

        return SafetensorsDataSource
    if name == "register":
        from .spark.register import register

        return register
    if name == "PysparkSafetensorsError":  # through format's package, which loads numpy
        from .errors import PysparkSafetensorsError

        return PysparkSafetensorsError
    raise AttributeError(f"module 'pyspark_safetensors' has no attribute {name!r}")
