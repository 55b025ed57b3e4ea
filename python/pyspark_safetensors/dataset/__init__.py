"""The dataset layer: manifest, tensor index, layout and the transactional commit.

Knows files and the format; knows neither Spark nor torch.
"""

from .arrays import write_batch_dataset
from .commit import (
    StagedShard,
    TaskResult,
    abort_dataset,
    attempt_dir,
    commit_dataset,
    merge_schemas,
)
from .index import INDEX_SCHEMA, index_rows, index_table, read_index, write_index
from .layout import INDEX, MANIFEST, STAGING, SUCCESS, local_path, resolve_inside, shard_name
from .manifest import (
    FORMAT_VERSION,
    ColumnSchema,
    Manifest,
    ManifestError,
    ShardEntry,
    load_manifest,
    write_manifest,
)
from .remote import RemoteDir, is_remote, open_location
from .verify import shard_crc32c, verify_dataset

__all__ = [
    "FORMAT_VERSION",
    "INDEX",
    "INDEX_SCHEMA",
    "MANIFEST",
    "STAGING",
    "SUCCESS",
    "ColumnSchema",
    "Manifest",
    "ManifestError",
    "RemoteDir",
    "ShardEntry",
    "StagedShard",
    "TaskResult",
    "abort_dataset",
    "attempt_dir",
    "commit_dataset",
    "index_rows",
    "index_table",
    "is_remote",
    "load_manifest",
    "local_path",
    "merge_schemas",
    "open_location",
    "read_index",
    "resolve_inside",
    "shard_crc32c",
    "shard_name",
    "verify_dataset",
    "write_batch_dataset",
    "write_index",
    "write_manifest",
]  # fmt: skip
