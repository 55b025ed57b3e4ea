"""The pipeline's error, apart so that every stage module may raise it without importing
the driver (``run``), which imports the stages."""

from ..format.errors import PysparkSafetensorsError


class PipelineError(PysparkSafetensorsError, ValueError):
    """A pipeline that cannot run as configured; the message says what to change."""
