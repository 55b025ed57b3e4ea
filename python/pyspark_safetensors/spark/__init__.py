"""The Spark layer: the ``safetensors`` data source (writer and reader) and its options.

``SafetensorsDataSource`` is loaded on first use: Spark 3.5 has no Python Data Source API
(``pyspark.sql.datasource``), and the rest of the layer (the JVM shim's lookup, the tensor
functions, the local session) works there through the JVM source."""

__all__ = ["SafetensorsDataSource"]


def __getattr__(name):
    if name == "SafetensorsDataSource":
        from .source import SafetensorsDataSource

        return SafetensorsDataSource
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
