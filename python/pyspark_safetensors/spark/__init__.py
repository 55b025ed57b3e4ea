"""The Spark layer: the ``safetensors`` data source (writer and reader) and its options."""

from .source import SafetensorsDataSource

__all__ = ["SafetensorsDataSource"]
