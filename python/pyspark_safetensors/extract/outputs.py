"""The output formats of an extraction: what the job writes from the model's sample rows.

An output format is any object with the ``ExtractionOutput`` methods. The job asks each
one ``config`` asks for (``outputs_for``) whether it can take the model's hook points, then hands
it the persisted sample rows (``SampleRows``) and the output location; the tables
(``samples.parquet``, ``texts.jsonl``) and ``extraction.json`` are the job's own. Two
formats exist: ``SafetensorsDatasets`` here (always on) and the Zarr sharded run
(``interop.zarr.extract_output.ZarrRunOutput``, ``zarr_run=True``). Another format
(Parquet, a Delta table, ...) is a new module with one class (its
``for_config`` reads the config field that turns it on) and an entry in ``OUTPUT_FORMATS``.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from typing import Protocol

from ..dataset import DatasetLocation, verify_dataset
from ..dataset.layout import partition_dir
from ..format import get_dtype
from .config import ExtractConfig
from .model import ExtractionError, Hook


@dataclass(frozen=True)
class SampleRows:
    """What an output format is given: the model's output on every text."""

    samples: object
    """The persisted DataFrame: sample_id, window, key, seq_len, first_pos, text_chars, source and
    one Tensor Struct ``[seq_len, H]`` per hook point (column ``Hook.column``)."""
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


class ExtractionOutput(Protocol):
    """One output format of an extraction."""

    name: str
    """The entry it writes under the output directory (a dataset or directory name)."""

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

    def write(self, out: DatasetLocation, rows: SampleRows) -> None:
        """Write it under ``out``, whole (each dataset committed, each store published)
        before returning; ``extraction.json`` comes after every output."""
        ...


def token_dataset_name(hook: Hook, partitioned: bool = False) -> str:
    """Where a hook point's token-level dataset is: its own dataset, or its partition of
    the one dataset partitioned by hook point (``partition_by_hook``)."""
    if partitioned:
        return f"activations/{partition_dir('hook', hook.name)}"
    return f"activations/{hook.column}"


@dataclass(frozen=True)
class SafetensorsDatasets:
    """The safetensors datasets, written through the Spark writer (its commit is atomic on
    any storage): ``activations/{hook}/`` token-level batch datasets (or, with
    ``partition_by_hook``, ``activations/`` partitioned by hook point), and the ``samples/``
    KV dataset (key -> one ``[seq_len, H]`` per hook point) when ``kv_dataset`` is on."""

    kv_dataset: bool = True
    partition_by_hook: bool = False
    name: str = "activations"

    @classmethod
    def for_config(cls, config: ExtractConfig) -> SafetensorsDatasets:
        return cls(kv_dataset=config.kv_dataset, partition_by_hook=config.partition_by_hook)

    def target_refusal(self, target: str, local: bool) -> str | None:
        return None

    def widths_refusal(self, widths: dict[str, int]) -> str | None:
        return None

    def write(self, out: DatasetLocation, rows: SampleRows) -> None:
        if self.partition_by_hook:
            self._partitioned_tokens(out, rows)
        else:
            for hook in rows.hooks:
                self._token_dataset(out, rows, hook)
        if self.kv_dataset:
            _save(
                rows,
                rows.samples.select("key", *[h.column for h in rows.hooks]).write.option(
                    "name_col", "key"
                ),
                {"hook_points": json.dumps([h.name for h in rows.hooks])},
                out.display("samples"),
            )
        for hook in rows.hooks:  # each dataset whole before the extraction is marked finished
            name = out.display(token_dataset_name(hook, self.partition_by_hook))
            verify_dataset(DatasetLocation.of(name, storage_options=rows.storage_options))

    @staticmethod
    def _tokens(rows: SampleRows, hook: Hook):
        """One row per token (``activation`` [H], ``sample_id``, ``token_pos``, ``window``)
        from the sample rows [seq_len, H], in Spark's own expressions: each token's bytes
        are a slice of its sample's (no trip through a Python worker)."""
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
    def _token_dataset(cls, out: DatasetLocation, rows: SampleRows, hook: Hook) -> None:
        _save(
            rows,
            cls._tokens(rows, hook).write.option("batch_size", rows.rows_per_shard),
            {"hook_point": hook.name, "d_model": str(rows.widths[hook.name])},
            out.display(token_dataset_name(hook)),
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
