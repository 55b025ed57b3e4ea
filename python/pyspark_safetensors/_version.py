"""The package's version, in a module of its own: the layers that record it (shard
headers, manifests) import it without importing the package root."""

__version__ = "0.1.0"
