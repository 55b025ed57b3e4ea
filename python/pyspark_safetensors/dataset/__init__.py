"""The dataset layer: where a dataset lives (``DatasetLocation``), the manifest, the
tensor index, names and the commit protocol.

Knows files and the format; knows neither Spark nor torch.
"""

from .arrays import write_batch_dataset
from .commit import (
    AppendError,
    ConcurrentCommitError,
    StagedShard,
    TaskResult,
    abort_dataset,
    begin_job,
    check_append,
    commit_dataset,
    lease_name,
    merge_schemas,
    reclaim,
)
from .index import INDEX_SCHEMA, index_rows, index_table, read_index, write_index
from .layout import (
    INDEX,
    MANIFEST,
    STAGING,
    SUCCESS,
    attempt_uuid,
    check_kv_columns,
    kv_tensor_name,
    resolve_inside,
    shard_name,
    split_kv_name,
)
from .location import (
    DatasetLocation,
    DatasetReplacedError,
    SpecialFileError,
    StorageError,
    split_storage_options,
)
from .manifest import (
    FORMAT_VERSION,
    ColumnSchema,
    Manifest,
    ManifestError,
    ShardEntry,
    load_manifest,
    write_manifest,
)
from .verify import shard_crc32c, verify_dataset

__all__ = [
    "FORMAT_VERSION",
    "INDEX",
    "INDEX_SCHEMA",
    "MANIFEST",
    "STAGING",
    "SUCCESS",
    "AppendError",
    "ColumnSchema",
    "ConcurrentCommitError",
    "DatasetLocation",
    "DatasetReplacedError",
    "Manifest",
    "ManifestError",
    "ShardEntry",
    "SpecialFileError",
    "StagedShard",
    "StorageError",
    "TaskResult",
    "abort_dataset",
    "attempt_uuid",
    "begin_job",
    "check_append",
    "check_kv_columns",
    "commit_dataset",
    "index_rows",
    "index_table",
    "kv_tensor_name",
    "lease_name",
    "load_manifest",
    "merge_schemas",
    "read_index",
    "reclaim",
    "resolve_inside",
    "shard_crc32c",
    "shard_name",
    "split_kv_name",
    "split_storage_options",
    "verify_dataset",
    "write_batch_dataset",
    "write_index",
    "write_manifest",
]  # fmt: skip
