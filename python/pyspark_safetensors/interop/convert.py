"""``convert SRC DST --to FORMAT``: one entry point over every converter.

The source format is detected from what SRC holds; each (source, target) pair is one
function in the module of the foreign format, called as
``fn(src, dst, *, dtype=None, workers=1, progress=True)``. Every converter builds its
output under a staging name and publishes it whole (``dataset.publish``), so a failure
leaves nothing at DST or beside it, and raises ``ConversionError`` (a ``ValueError``)
with one line naming the file or key at fault.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Literal

from ..dataset.layout import MANIFEST
from ..format.errors import PysparkSafetensorsError

Source = Literal["safetensors", "saev", "zarr", "zarr-run"]
Target = Literal["safetensors", "saev", "zarr"]
TARGETS: tuple[Target, ...] = ("safetensors", "saev", "zarr")


class ConversionError(PysparkSafetensorsError, ValueError):
    """A conversion that cannot be done: the message names the file or key at fault."""


# (source, target) -> "module:function" inside this package, imported on use.
CONVERTERS: dict[tuple[Source, Target], str] = {
    ("saev", "safetensors"): "saev:saev_to_dataset",
    ("safetensors", "saev"): "saev:dataset_to_saev",
    ("saev", "zarr"): "zarr:saev_to_zarr",
    ("zarr", "safetensors"): "zarr:zarr_to_dataset",
    ("zarr-run", "safetensors"): "zarr:zarr_to_dataset",
    ("zarr-run", "zarr"): "zarr:merge_run",
    ("safetensors", "zarr"): "zarr:dataset_to_zarr",
}


def detect_source(path: str | os.PathLike) -> Source:
    """What ``path`` holds: our dataset (``dataset_manifest.json``), a Zarr sharded run
    (``manifest.json`` + ``shards/``), a Zarr store (``.zgroup``/``.zattrs``), or a saev
    dump (``metadata.json`` + ``acts*.bin``, or a ``dump_to`` directory holding one)."""
    p = Path(path)
    if not p.exists():
        raise ConversionError(f"{p}: no such file or directory")
    if not p.is_dir():
        raise ConversionError(f"{p}: expected a directory (a dataset, a saev dump or a Zarr store)")
    if (p / MANIFEST).is_file():
        return "safetensors"
    if (p / "manifest.json").is_file() and (p / "shards").is_dir():
        return "zarr-run"
    if any((p / name).is_file() for name in (".zgroup", ".zattrs", "zarr.json")):
        return "zarr"
    if (p / "metadata.json").is_file() or any(
        (child / "metadata.json").is_file()
        for child in p.iterdir()
        if child.is_dir() and not child.name.startswith(".")  # not a dump still being staged
    ):
        return "saev"
    raise ConversionError(
        f"{p}: not a safetensors dataset ({MANIFEST}), a saev dump (metadata.json + acts*.bin), "
        "a Zarr store (.zgroup) or a Zarr sharded run (manifest.json + shards/)"
    )


def converter(source: Source, to: Target):
    """The function converting ``source`` to ``to``."""
    if to not in TARGETS:
        raise ConversionError(f"unknown target format {to!r}; choose one of {', '.join(TARGETS)}")
    spec = CONVERTERS.get((source, to))
    if spec is None:
        raise ConversionError(f"no converter from a {source} source to {to}")
    module, name = spec.split(":")
    return getattr(importlib.import_module(f"{__package__}.{module}"), name)


def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    to: Target,
    dtype: str | None = None,
    workers: int = 1,
    progress: bool = True,
) -> Path:
    """Convert ``src`` (format detected) to ``to`` at ``dst``; returns what was written.

    convert("dumps/ab12...", "out/acts", to="safetensors")
    """
    if workers < 1:
        raise ConversionError(f"workers must be >= 1, got {workers}")
    fn = converter(detect_source(src), to)
    return Path(fn(Path(src), Path(dst), dtype=dtype, workers=workers, progress=progress))
