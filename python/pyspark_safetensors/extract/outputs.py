"""The output formats of an extraction: what the job writes from the model's sample rows.

An output format is any object with the ``ExtractionOutput`` methods. The job asks each
one ``config`` asks for (``outputs_for``) whether it can take the model's hook points. An
output is written in one of two ways, or both:

- by the model stage's own tasks, as they compute (``stage_writes``): each dataset a
  ``WriteJob`` of the Spark writer carried into the tasks and committed by the driver
  after the stage, its rows made in the task from each batch of sample rows. The
  activations go from the model to the shards in the same process: no trip through the
  JVM, no stored rows read back;
- after the stage, from the stored sample rows (``reads_rows``, then ``write``).

The tables (``samples.parquet``, ``texts.jsonl``) and ``extraction.json`` are the job's
own. Three formats exist: ``SafetensorsDatasets`` here (always on), the Zarr sharded run
(``interop.zarr.extract_output.ZarrRunOutput``, ``zarr_run=True``) and an image
extraction's saev dump (``interop.saev.extract_output.SaevDumpOutput``,
``saev_dump=True``). Another format
(Parquet, a Delta table, ...) is a new module with one class (its ``for_config`` reads
the config field that turns it on) and an entry in ``OUTPUT_FORMATS``.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import pyarrow as pa

from ..dataset import DatasetLocation, verify_dataset
from ..dataset.layout import partition_dir
from ..format import get_dtype
from .config import ExtractConfig
from .model import ExtractionError, Hook
from .vision import TOKEN_KINDS, ImageTokens, hook_layer


@dataclass(frozen=True)
class SampleRows:
    """What an output format is given: the model's output on every text."""

    samples: object
    """The stored DataFrame: sample_id, window, key, seq_len, first_pos, text_chars, source and
    one Tensor Struct ``[seq_len, H]`` per hook point (column ``Hook.column``); the
    same columns as each batch a stage write gets. None before the model stage, and when
    no output ``reads_rows``."""
    hooks: tuple[Hook, ...]
    widths: dict[str, int]
    """Hidden width by hook name."""
    dtype: str
    max_length: int
    rows_per_shard: int
    metadata: dict[str, str]
    """What every output records about the extraction (model, weights hash, dtype,
    tokenizer settings, config hash, corpus)."""
    storage_options: dict[str, str]
    """The Spark writer's storage options for a URI output (empty for a local one)."""
    image_tokens: ImageTokens | None = None
    """An image corpus's token layout (CLS, registers, patch grid), None for texts. Its
    sample rows are one per image (``sample_id`` = ``image_id``, ``seq_len`` = every
    token, ``source`` its path) with ``images.IMAGE_COLUMNS``, and each task's rows are
    a contiguous range of image_id in order."""
    hook_metadata: dict[str, dict[str, str]] = field(default_factory=dict)
    """What a hook point's token dataset records beyond ``metadata``, by hook name (an
    MLP's input or output: ``mlp_layer``, ``mlp_block``)."""
    append: bool = False
    """Whether the stage writes append to the datasets (a later group of a grouped
    extraction) instead of overwriting them."""


@dataclass(frozen=True)
class StageWrite:
    """A dataset the model stage's tasks write as they compute."""

    job: object
    """The dataset's ``spark.writer.WriteJob``: made on the driver (it holds the job's
    lease), carried into the tasks, committed by the driver after the stage."""
    rows: Callable[[pa.RecordBatch], pa.RecordBatch]
    """The dataset's rows from one batch of sample rows (run in the tasks)."""


class ExtractionOutput(Protocol):
    """One output format of an extraction."""

    name: str
    """The entry it writes under the output directory (a dataset or directory name)."""

    reads_rows: bool
    """Whether ``write`` reads the stored sample rows (the model stage then stores them)."""

    @classmethod
    def for_config(cls, config: ExtractConfig) -> ExtractionOutput | None:
        """The output ``config`` asks for, or None when it asks for none of this format."""
        ...

    def target_refusal(self, target: str, local: bool) -> str | None:
        """Why it cannot write to ``target`` (``local``: a local directory), or None;
        checked before the model loads."""
        ...

    def widths_refusal(self, widths: dict[str, int]) -> str | None:
        """Why it cannot take hook points of these widths (by hook name), or None;
        checked on the driver before any task runs."""
        ...

    def stage_writes(self, out: DatasetLocation, rows: SampleRows) -> list[StageWrite]:
        """The datasets under ``out`` the model stage's tasks write (``rows.samples`` is
        None here); the job commits them after the stage, or aborts them."""
        ...

    def write(self, out: DatasetLocation, rows: SampleRows) -> None:
        """Finish it under ``out``, whole (each dataset committed, each store published)
        before returning; ``extraction.json`` comes after every output."""
        ...

    # Optional: an output without it takes any partitioning (``partition_multiple``).
    # def images_per_partition_multiple(self, rows: SampleRows) -> int:
    #     """For an image corpus: the number the image partitions' boundaries fall on
    #     multiples of (e.g. the images of one shard written by one task)."""


def partition_multiple(outputs, rows: SampleRows) -> int:
    """The number every image partition boundary falls on a multiple of: the least
    common multiple of what the outputs ask (``images_per_partition_multiple``; 1 where
    an output does not define it)."""
    import math

    multiple = 1
    for output in outputs:
        ask = getattr(output, "images_per_partition_multiple", None)
        if ask is not None:
            multiple = math.lcm(multiple, max(1, int(ask(rows))))
    return multiple


TOKEN_INDEX_BYTES = 16
"""Bytes of a text token's row beside its activation: ``sample_id`` (int64), ``token_pos``
and ``window`` (int32)."""


def token_row_bytes(width: int, dtype: str) -> int:
    """Bytes of one row of a text extraction's token-level dataset (shard headers aside,
    under a kilobyte each): the activation and ``TOKEN_INDEX_BYTES``."""
    return width * get_dtype(dtype).itemsize + TOKEN_INDEX_BYTES


def token_dataset_name(hook: Hook, partitioned: bool = False) -> str:
    """Where a hook point's token-level dataset is: its own dataset, or its partition of
    the one dataset partitioned by hook point (``partition_by_hook``)."""
    if partitioned:
        return f"activations/{partition_dir('hook', hook.name)}"
    return f"activations/{hook.column}"


@dataclass(frozen=True)
class SafetensorsDatasets:
    """The safetensors datasets, written by the Spark writer's jobs (their commit is
    atomic on any storage): ``activations/{hook}/`` token-level batch datasets and the
    ``samples/`` KV dataset (key -> one ``[seq_len, H]`` per hook point, when
    ``kv_dataset`` is on), both by the model stage's tasks; or, with
    ``partition_by_hook``, ``activations/`` partitioned by hook point, which only the JVM
    source writes (``partitionBy``), from the stored rows."""

    kv_dataset: bool = True
    partition_by_hook: bool = False
    name: str = "activations"

    @classmethod
    def for_config(cls, config: ExtractConfig) -> SafetensorsDatasets:
        return cls(kv_dataset=config.kv_dataset, partition_by_hook=config.partition_by_hook)

    @property
    def reads_rows(self) -> bool:
        return self.partition_by_hook

    def target_refusal(self, target: str, local: bool) -> str | None:
        return None

    def widths_refusal(self, widths: dict[str, int]) -> str | None:
        return None

    def stage_writes(self, out: DatasetLocation, rows: SampleRows) -> list[StageWrite]:
        from functools import partial

        from pyspark.sql.types import IntegerType, LongType, StringType, StructField, StructType

        from ..spark.tensor_struct import TENSOR_STRUCT_TYPE

        writes = []
        if not self.partition_by_hook:
            token_schema = StructType([
                StructField("activation", TENSOR_STRUCT_TYPE), StructField("sample_id", LongType()),
                StructField("token_pos", IntegerType()), StructField("window", IntegerType()),
                *(_image_token_fields() if rows.image_tokens else ()),
            ])  # fmt: skip
            for hook in rows.hooks:
                metadata = {"hook_point": hook.name, "d_model": str(rows.widths[hook.name]),
                            **rows.hook_metadata.get(hook.name, {})}  # fmt: skip
                if rows.image_tokens:
                    metadata.update(token_kinds=json.dumps(TOKEN_KINDS),
                                    layer=str(hook_layer(hook.name)))  # fmt: skip
                job = _write_job(
                    rows, token_schema, {"batch_size": rows.rows_per_shard}, metadata,
                    out.display(token_dataset_name(hook)),
                )  # fmt: skip
                tokens = partial(token_rows, column=hook.column, width=rows.widths[hook.name],
                                 dtype=rows.dtype, image_tokens=rows.image_tokens,
                                 layer=hook_layer(hook.name))  # fmt: skip
                writes.append(StageWrite(job, tokens))
        if self.kv_dataset:
            columns = [h.column for h in rows.hooks]
            kv_schema = StructType(
                [StructField("key", StringType())]
                + [StructField(c, TENSOR_STRUCT_TYPE) for c in columns]
            )
            job = _write_job(
                rows, kv_schema, {"name_col": "key"},
                {"hook_points": json.dumps([h.name for h in rows.hooks])}, out.display("samples"),
            )  # fmt: skip
            writes.append(StageWrite(job, partial(_select, columns=["key", *columns])))
        return writes

    def write(self, out: DatasetLocation, rows: SampleRows) -> None:
        if self.partition_by_hook:
            self._partitioned_tokens(out, rows)
        for hook in rows.hooks:  # each dataset whole before the extraction is marked finished
            name = out.display(token_dataset_name(hook, self.partition_by_hook))
            verify_dataset(DatasetLocation.of(name, storage_options=rows.storage_options))

    @staticmethod
    def _tokens(rows: SampleRows, hook: Hook):
        """``token_rows`` in Spark's own expressions, over the stored sample rows: each
        token's bytes are a slice of its sample's."""
        from pyspark.sql import functions as F

        width = rows.widths[hook.name]
        row_bytes = width * get_dtype(rows.dtype).itemsize
        tokens = rows.samples.select(
            "sample_id", "window", "first_pos", F.col(hook.column).data.alias("data"),
            F.posexplode(F.array_repeat(F.lit(0), F.col("seq_len"))).alias("i", "_"),
        )  # fmt: skip
        activation = F.struct(
            F.col("data").substr(F.col("i") * row_bytes + 1, F.lit(row_bytes)).alias("data"),
            F.array(F.lit(width)).alias("shape"),
            F.lit(rows.dtype).alias("dtype"),
        )
        # the position in the model input: a dropped BOS shifts the stored tokens by one
        token_pos = (F.col("i") + F.col("first_pos")).cast("int")
        return tokens.select(
            activation.alias("activation"), "sample_id", token_pos.alias("token_pos"), "window"
        )

    @classmethod
    def _partitioned_tokens(cls, out: DatasetLocation, rows: SampleRows) -> None:
        """Every hook point's tokens as one dataset partitioned by ``hook`` (the JVM
        source's ``partitionBy``: one commit for all of them)."""
        from functools import reduce

        from pyspark.sql import functions as F

        from ..spark.register import implementation

        if implementation(rows.samples.sparkSession) == "python":
            raise ExtractionError(
                "partition_by_hook needs the JVM source (the shim jar: local_session() or "
                "with_shim(builder)); the Python source cannot write partitions"
            )
        frames = [cls._tokens(rows, h).withColumn("hook", F.lit(h.name)) for h in rows.hooks]
        _save(
            rows,
            reduce(lambda a, b: a.unionByName(b), frames)
            .write.option("batch_size", rows.rows_per_shard)
            .partitionBy("hook"),
            {"hook_points": json.dumps([h.name for h in rows.hooks])},
            out.display("activations"),
        )


def _image_token_fields():
    """The token-level columns an image adds (Spark types: pyspark loads in the tasks)."""
    from pyspark.sql.types import ByteType, IntegerType, LongType, StructField

    return (
        StructField("image_id", LongType()), StructField("patch_row", IntegerType()),
        StructField("patch_col", IntegerType()), StructField("token_kind", ByteType()),
        StructField("layer", IntegerType()),
    )  # fmt: skip


def token_rows(
    samples: pa.RecordBatch, column: str, width: int, dtype: str,
    image_tokens: ImageTokens | None = None, layer: int = -1,
) -> pa.RecordBatch:  # fmt: skip
    """One row per token (``activation`` [H], ``sample_id``, ``token_pos``, ``window``)
    from a batch of sample rows (``column``: a hook point's Tensor Structs [seq_len, H]
    laid end to end, as the model stage builds them): one view of the samples' bytes, no
    copy per token. Images (``image_tokens``, every image all of its tokens) add
    ``image_id``, ``patch_row``, ``patch_col`` (-1 for CLS and registers),
    ``token_kind`` (the code of ``vision.TOKEN_KINDS``: 0 cls, 1 register, 2 patch) and
    ``layer`` (the hook point's block, -1 for none)."""
    from ..spark.tensor_struct import tensor_structs_of_rows

    seq_len = samples.column("seq_len").to_numpy().astype(np.int64)
    data = samples.column(column).flatten()[0]
    offset_type = np.int64 if pa.types.is_large_binary(data.type) else np.int32
    offsets = np.frombuffer(data.buffers()[1], offset_type)[
        data.offset : data.offset + len(data) + 1
    ]
    raw = np.frombuffer(data.buffers()[2], np.uint8)[offsets[0] : offsets[-1]]
    values = raw.view(get_dtype(dtype).numpy).reshape(-1, width)
    if len(values) != seq_len.sum():
        raise ExtractionError(
            f"{column}: {len(values)} token rows for {seq_len.sum()} tokens; the sample rows' "
            "activations must be laid end to end"
        )
    starts = np.repeat(np.cumsum(seq_len) - seq_len, seq_len)
    first_pos = np.repeat(samples.column("first_pos").to_numpy().astype(np.int64), seq_len)
    # the position in the model input: a dropped BOS shifts the stored tokens by one
    token_pos = np.arange(len(values), dtype=np.int64) - starts + first_pos
    sample_id = np.repeat(samples.column("sample_id").to_numpy(), seq_len)
    columns = {
        "activation": tensor_structs_of_rows(values, dtype),
        "sample_id": pa.array(sample_id),
        "token_pos": pa.array(token_pos.astype(np.int32)),
        "window": pa.array(np.repeat(samples.column("window").to_numpy(), seq_len)),
    }
    if image_tokens is not None:
        n = len(samples)
        columns.update(
            image_id=pa.array(sample_id),
            patch_row=pa.array(np.tile(image_tokens.patch_rows(), n)),
            patch_col=pa.array(np.tile(image_tokens.patch_cols(), n)),
            token_kind=pa.array(np.tile(image_tokens.kinds(), n)),
            layer=pa.array(np.full(len(values), layer, np.int32)),
        )
    return pa.RecordBatch.from_pydict(columns)


def _select(samples: pa.RecordBatch, columns: list[str]) -> pa.RecordBatch:
    return samples.select(columns)


def _write_job(rows: SampleRows, schema, options: dict, metadata: dict[str, str], uri: str):
    """A ``WriteJob`` of one dataset (an overwrite, or an append with ``rows.append``), as
    ``_save`` would write it."""
    from ..dataset import split_storage_options
    from ..spark.options import WriterOptions
    from ..spark.writer import WriteJob

    storage, parsed = split_storage_options({
        **rows.storage_options, **{k: str(v) for k, v in options.items()}, "path": uri,
        "metadata": json.dumps({**rows.metadata, **metadata}),
    })  # fmt: skip
    return WriteJob(WriterOptions.parse(parsed), schema, not rows.append, storage)


def _save(rows: SampleRows, writer, metadata: dict[str, str], uri: str) -> None:
    """One dataset through the Spark writer."""
    (
        writer.format("safetensors")
        .options(**rows.storage_options)
        .option("metadata", json.dumps({**rows.metadata, **metadata}))
        .mode("overwrite")
        .save(uri)
    )


OUTPUT_FORMATS = (
    "extract.outputs:SafetensorsDatasets",
    "interop.zarr.extract_output:ZarrRunOutput",
    "interop.saev.extract_output:SaevDumpOutput",
)
"""Every output format, as ``module:class`` inside this package (imported when a job
runs), in the order they are written."""


def outputs_for(config: ExtractConfig) -> list[ExtractionOutput]:
    """The output formats ``config`` asks for, in the order they are written."""
    outputs = []
    for entry in OUTPUT_FORMATS:
        module, name = entry.split(":")
        cls = getattr(importlib.import_module(f"{__package__.rsplit('.', 1)[0]}.{module}"), name)
        output = cls.for_config(config)
        if output is not None:
            outputs.append(output)
    return outputs
