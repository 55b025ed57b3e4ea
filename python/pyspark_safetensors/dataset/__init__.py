"""The dataset layer: where a dataset lives (``DatasetLocation``), the manifest, the
tensor index, names and the commit protocol.

Knows files and the format; knows neither Spark nor torch.
"""

from .arrays import write_batch_dataset
from .build import DatasetBuilder, stage_shard
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
from .errors import (
    DatasetReplacedError,
    ManifestError,
    PartitionedDatasetError,
    SpecialFileError,
    StorageError,
)
from .index import (
    INDEX_SCHEMA,
    ShardIndex,
    check_index,
    index_rows,
    index_table,
    read_index,
    read_shard_index,
    shard_columns,
)
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
from .location import DatasetLocation, split_storage_options
from .manifest import (
    FORMAT_VERSION,
    ColumnSchema,
    Manifest,
    ShardEntry,
    load_manifest,
    write_manifest,
)
from .shards import (
    LocalShard,
    RemoteShard,
    ShardBytes,
    ShardReader,
    open_shard,
    open_shard_bytes,
    read_header,
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
    "DatasetBuilder",
    "DatasetLocation",
    "DatasetReplacedError",
    "LocalShard",
    "Manifest",
    "ManifestError",
    "PartitionedDatasetError",
    "RemoteShard",
    "ShardBytes",
    "ShardEntry",
    "ShardIndex",
    "ShardReader",
    "SpecialFileError",
    "StagedShard",
    "StorageError",
    "TaskResult",
    "abort_dataset",
    "attempt_uuid",
    "begin_job",
    "check_append",
    "check_index",
    "check_kv_columns",
    "commit_dataset",
    "index_rows",
    "index_table",
    "kv_tensor_name",
    "lease_name",
    "load_manifest",
    "merge_schemas",
    "open_shard",
    "open_shard_bytes",
    "read_header",
    "read_index",
    "read_shard_index",
    "reclaim",
    "resolve_inside",
    "shard_columns",
    "shard_crc32c",
    "shard_name",
    "split_kv_name",
    "split_storage_options",
    "stage_shard",
    "verify_dataset",
    "write_batch_dataset",
    "write_manifest",
]  # fmt: skip
