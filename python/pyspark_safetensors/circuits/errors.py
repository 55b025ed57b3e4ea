"""The replacement model's error, apart so that every module of ``circuits`` raises it
without importing another."""

from __future__ import annotations

from ..format.errors import PysparkSafetensorsError


class ReplacementError(PysparkSafetensorsError, ValueError):
    """A dictionary that does not fit the model it should replace the MLPs of."""
