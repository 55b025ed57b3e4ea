"""The dataset layer's errors, below every module of it (storage and manifest rules alike
raise them, so neither needs to import the other for them)."""

from __future__ import annotations

from ..format.errors import PysparkSafetensorsError


class ManifestError(PysparkSafetensorsError, ValueError):
    """A manifest is missing, malformed or disagrees with the files it lists."""


class StorageError(PysparkSafetensorsError, OSError):
    """An I/O error while reading or writing a dataset, naming the dataset and the file."""


class SpecialFileError(ManifestError):
    """A name the manifest lists is not a regular file (a FIFO, directory or device)."""


class DatasetReplacedError(ManifestError):
    """A shard the reader's manifest lists is gone: the dataset was replaced or deleted
    since it was opened."""


class PartitionedDatasetError(ManifestError):
    """A reader that takes one dataset was given the root of a partitioned one."""
