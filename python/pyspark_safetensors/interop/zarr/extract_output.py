"""The extraction's Zarr output: the sample rows of a Spark extraction written as a Zarr
sharded run, one shard per Spark task (one writer per store, published whole under the
partition's name, so a retried task replaces its shard), ``manifest.json`` written last
by the driver. pyspark is imported only inside the task function (for the partition id);
the DataFrame arrives from the caller.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from ...format import get_dtype
from .write import KEY_BYTES, StoreWriter, shard_path, write_run_manifest


def _zarr_shard_fn(run_dir: str, columns: list[str], width: int, t_max: int, dtype: str, attrs):
    """The function each Spark task runs: its sample rows -> one Zarr shard written by one
    writer (published whole under the partition's name), one row per sample out."""

    def write_partition_shard(batches):
        from pyspark import TaskContext

        shard_id = TaskContext.get().partitionId()
        writer, ids, windows = None, [], []
        try:
            for batch in batches:
                if writer is None and batch.num_rows:
                    writer = StoreWriter(
                        Path(run_dir) / shard_path(shard_id), num_layers=len(columns),
                        hidden_size=width, t_max=t_max,
                        model_id=attrs["model"], attrs=attrs,
                    )  # fmt: skip
                seq_lens = batch.column("seq_len").to_pylist()
                keys, sources = batch.column("key").to_pylist(), batch.column("source").to_pylist()
                sids, wins = (
                    batch.column("sample_id").to_pylist(),
                    batch.column("window").to_pylist(),
                )
                for row, n in enumerate(seq_lens):
                    acts = np.stack([_tensor(batch, c, row, n, width, dtype) for c in columns])
                    writer.add(
                        acts,
                        sample_key=zarr_sample_key(keys[row]),
                        extra={"key": keys[row], "sample_id": sids[row], "window": wins[row],
                               "source": sources[row]},
                    )  # fmt: skip
                ids += sids
                windows += wins
            if writer is not None:
                writer.close()
        except BaseException:
            if writer is not None:
                writer.abort()
            raise
        yield pa.RecordBatch.from_pydict({
            "shard_id": pa.array([shard_id] * len(ids), pa.int32()),
            "local_index": pa.array(range(len(ids)), pa.int32()),
            "sample_id": pa.array(ids, pa.int64()),
            "window": pa.array(windows, pa.int32()),
        })  # fmt: skip

    return write_partition_shard


def zarr_sample_key(key: str) -> str:
    """The key itself when a store takes it (``KEY_BYTES``), else its sha256 (a window's
    key, ``{sha256}-w{i}``, is longer)."""
    if len(key.encode()) <= KEY_BYTES:
        return key
    return hashlib.sha256(key.encode()).hexdigest()


def _tensor(batch, column, row, n, width, dtype) -> np.ndarray:
    """One sample's ``[n, width]`` activations of one hook point, as stored in the row."""
    data = batch.column(column).field("data")[row].as_buffer()
    values = np.frombuffer(data, get_dtype(dtype).numpy).reshape(n, width)
    # bfloat16 widens exactly; the store rounds to float16 (nearest even)
    return values.astype(np.float32) if dtype == "BF16" else values


def write_zarr_run(samples, columns: list[str], width: int, run_dir: Path, *, t_max: int,
                   dtype: str, attrs: dict) -> None:  # fmt: skip
    """The sample rows (a DataFrame with ``sample_id``, ``window``, ``key``, ``seq_len``,
    ``source`` and one Tensor Struct ``[seq_len, width]`` per layer in ``columns``) as a
    Zarr sharded run at ``run_dir``: each Spark task writes its partition as one shard;
    the driver then numbers the samples by (sample_id, window) and writes
    ``manifest.json`` last."""
    from ...spark.compat import to_arrow

    placed = to_arrow(
        samples.select("sample_id", "window", "key", "seq_len", "source", *columns).mapInArrow(
            _zarr_shard_fn(str(run_dir), columns, width, t_max, dtype, attrs),
            "shard_id int, local_index int, sample_id long, window int",
        )
    ).sort_by([("sample_id", "ascending"), ("window", "ascending")])
    placement = list(
        zip(placed.column("shard_id").to_pylist(), placed.column("local_index").to_pylist(),
            strict=True)
    )  # fmt: skip
    write_run_manifest(run_dir, placement)


@dataclass(frozen=True)
class ZarrRunOutput:
    """An output format of the extraction (``extract.outputs.ExtractionOutput``): the
    samples as a Zarr sharded run, ``samples_zarr/``, layers = the hook points in order,
    ``T_max`` = the extraction's ``max_length``. Chosen by ``ExtractConfig.zarr_run``."""

    name: str = "samples_zarr"
    reads_rows: bool = True

    @classmethod
    def for_config(cls, config) -> ZarrRunOutput | None:
        """``config``: an ``extract.ExtractConfig``."""
        return cls() if config.zarr_run else None

    def target_refusal(self, target: str, local: bool) -> str | None:
        if local:  # each task publishes its shard with a local rename
            return None
        return (
            f"zarr_run writes its Zarr stores to a local directory, not to {target}; "
            "extract to a local path, or leave zarr_run off and convert the samples "
            "dataset later (pyspark-safetensors convert)"
        )

    def widths_refusal(self, widths: dict[str, int]) -> str | None:
        if len(set(widths.values())) != 1:
            return f"zarr_run needs hook points of one width (a store is (N, L, T_max, H)); got {widths}"
        return None

    def stage_writes(self, out, rows) -> list:
        return []

    def write(self, out, rows) -> None:
        """``out``: the extraction's ``DatasetLocation`` (local); ``rows``: its
        ``extract.outputs.SampleRows``."""
        attrs = {**rows.metadata, "hook_points": [h.name for h in rows.hooks]}
        write_zarr_run(
            rows.samples, [h.column for h in rows.hooks], next(iter(rows.widths.values())),
            Path(out.local_file(self.name)), t_max=rows.max_length, dtype=rows.dtype, attrs=attrs,
        )  # fmt: skip
