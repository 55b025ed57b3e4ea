"""Other activation formats: saev sharded dumps (``interop.saev``), Zarr activation stores
(``interop.zarr``), and the converters between them and our datasets
(``interop.convert``). Submodules import their heavy dependencies (torch, zarr) lazily.
"""

from .convert import ConversionError, convert, detect_source

__all__ = ["ConversionError", "convert", "detect_source"]
