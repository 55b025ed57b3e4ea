"""saev sharded-activation dumps (protocol v1): read, write, verify, view, convert.

numpy only at import; ``SaevDataset`` / ``open_saev`` (torch) load on first use.

    from pyspark_safetensors.interop.saev import SaevDump, open_saev
    dump = SaevDump("shards")                      # dump_to or hash directory
    ds = open_saev("shards", patches="image", layer=-2)   # map-style torch dataset
"""

from .convert import dataset_to_saev, saev_to_dataset
from .dump import DumpWriter, SaevDump, find_dump, verify_dump, write_dump
from .protocol import DumpError, Metadata, View, metadata_hash, new_metadata, parse_metadata

__all__ = [
    "DumpError",
    "DumpWriter",
    "Metadata",
    "SaevDataset",
    "SaevDump",
    "View",
    "dataset_to_saev",
    "find_dump",
    "metadata_hash",
    "new_metadata",
    "open_saev",
    "parse_metadata",
    "saev_to_dataset",
    "verify_dump",
    "write_dump",
]


def __getattr__(name: str):
    if name in ("SaevDataset", "open_saev"):
        from . import dataset

        return getattr(dataset, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
