"""The package's error base, ``PysparkSafetensorsError``: every error raised for a user
derives from it (and from the built-in it refines, ``ValueError``, ``TypeError``,
``OSError``, ...). Defined in ``format.errors``, the lowest layer, so that ``format``
(numpy only) can raise it without importing upward; re-exported here and at the root.

    try:
        ...
    except PysparkSafetensorsError as e:  # a mistake in the input: e says which
        ...
"""

from .format.errors import InvalidArgumentError, InvalidTypeError, PysparkSafetensorsError

__all__ = ["InvalidArgumentError", "InvalidTypeError", "PysparkSafetensorsError"]
