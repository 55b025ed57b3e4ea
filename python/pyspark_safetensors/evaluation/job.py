"""Synthetic datasets with known features, generated in Spark.

``write_synthetic_dataset`` draws ``rows`` samples of a saved ``SyntheticModel`` in
partitions of ``rows_per_partition`` rows: partition ``p`` holds rows ``[p R, (p + 1) R)``,
drawn from a generator seeded by ``(seed, p)`` alone, so a dataset is the same whatever
the cluster, the number of executors or a retried task; each task draws in chunks of at
most ``CHUNK_ELEMENTS`` feature activations (its memory is bounded whatever ``rows``).
The rows go through the ``safetensors`` data source in batch mode, columns:

- ``activation`` ``[H]`` float32: the sample ``x`` (what the trainer reads by default);
- ``feature_indices`` ``[max_active]`` int32 and ``feature_values`` ``[max_active]`` float32:
  its true feature activations, sparse (the active features in increasing order, padded
  with index -1 and value 0);
- ``row`` int64: the sample's number.

``max_active`` (0: chosen on the driver, twice the largest count of a 16,384-row sample
plus 16) caps the active features of a row; a task that meets a row over it fails the
job, which then publishes nothing, naming the setting. The manifest's metadata records
the model's configuration, the seed and ``max_active``.

``synthetic_datasets`` builds a model from its configuration, saves it and writes a
training and an evaluation set from two seeds.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..format.errors import InvalidArgumentError

ACTIVATION, FEATURE_INDICES, FEATURE_VALUES, ROW = (
    "activation",
    "feature_indices",
    "feature_values",
    "row",
)
#: Feature activations a task holds at once (a chunk of rows x F): 16 MiB of float32.
CHUNK_ELEMENTS = 1 << 22
#: Rows of the driver's sample that sets ``max_active`` when none is given.
PILOT_ROWS = 16_384


@dataclass(frozen=True)
class SyntheticDataConfig:
    """One synthetic dataset of a saved model (module docstring)."""

    model: str
    """Directory of the synthetic model (``SyntheticModel.save``, or SAELens' own)."""
    output: str
    """Where the dataset goes (a path or URI); replaced if it exists."""
    rows: int
    """Samples to draw."""
    seed: int = 0
    """Seed of the samples: partition p draws from (seed, p)."""
    rows_per_partition: int = 65_536
    """Rows of one Spark task (and of the generator stream of one partition)."""
    rows_per_shard: int = 16_384
    """Rows per safetensors shard."""
    max_active: int = 0
    """Width of the sparse truth columns (0: from a sample on the driver)."""

    def __post_init__(self):
        if self.rows < 1 or self.rows_per_partition < 1 or self.rows_per_shard < 1:
            raise InvalidArgumentError("rows, rows_per_partition and rows_per_shard must be >= 1")
        if self.max_active < 0:
            raise InvalidArgumentError("max_active must be >= 0 (0: chosen from a sample)")


def partition_generator(seed: int, partition: int):
    """The ``torch.Generator`` of partition ``partition`` of a dataset of seed ``seed``."""
    import torch

    state = np.random.SeedSequence([seed, partition]).generate_state(2, np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 31 | int(state[1]) >> 1)


_MODELS: dict[str, object] = {}


def _model(path: str):
    """The model at ``path``, loaded once per Python worker (a local copy of a URI)."""
    from .synthetic import SyntheticModel

    if path not in _MODELS:
        _MODELS[path] = SyntheticModel.load(_local(path))
    return _MODELS[path]


def draw_rows(model, seed: int, partition: int, start: int, stop: int, max_active: int):
    """Rows ``[start, stop)`` of partition ``partition`` as numpy columns, in chunks:
    yields ``{activation, feature_indices, feature_values, row}`` per chunk."""
    import torch

    gen = partition_generator(seed, partition)
    chunk = max(1, CHUNK_ELEMENTS // model.num_features)
    for lo in range(start, stop, chunk):
        hi = min(lo + chunk, stop)
        x, acts = model.sample(hi - lo, gen)
        counts = (acts > 0).sum(1)
        widest = int(counts.max()) if len(counts) else 0
        if widest > max_active:
            raise InvalidArgumentError(
                f"row {lo + int(counts.argmax())} has {widest} active features, more than "
                f"max_active={max_active}; write the dataset again with a larger max_active"
            )
        # the active features of each row first, in increasing order, then the padding
        order = torch.sort((acts <= 0).to(torch.int8), dim=1, stable=True).indices[:, :max_active]
        values = torch.gather(acts, 1, order)
        indices = torch.where(values > 0, order, -1).to(torch.int32)
        yield {
            ACTIVATION: x.numpy().astype(np.float32, copy=False),
            FEATURE_INDICES: indices.numpy(),
            FEATURE_VALUES: values.numpy().astype(np.float32, copy=False),
            ROW: np.arange(lo, hi, dtype=np.int64),
        }


def _arrow_batch(columns: dict):
    import pyarrow as pa

    arrays = []
    for name in (ACTIVATION, FEATURE_INDICES, FEATURE_VALUES):
        flat = columns[name]
        offsets = pa.array(np.arange(0, flat.size + 1, flat.shape[1], dtype=np.int32))
        arrays.append(pa.ListArray.from_arrays(offsets, pa.array(flat.reshape(-1))))
    arrays.append(pa.array(columns[ROW]))
    return pa.RecordBatch.from_arrays(arrays, names=[ACTIVATION, FEATURE_INDICES, FEATURE_VALUES,
                                                     ROW])  # fmt: skip


def _task(config: SyntheticDataConfig, max_active: int):
    def generate(batches):
        model = _model(config.model)
        for batch in batches:
            for p in batch.column("id").to_pylist():
                start = p * config.rows_per_partition
                stop = min(start + config.rows_per_partition, config.rows)
                for columns in draw_rows(model, config.seed, p, start, stop, max_active):
                    yield _arrow_batch(columns)

    return generate


def choose_max_active(model, seed: int) -> int:
    """Twice the largest active count of a ``PILOT_ROWS`` sample, plus 16."""
    gen = partition_generator(seed, 1 << 32)  # no partition's
    widest = 0
    chunk = max(1, CHUNK_ELEMENTS // model.num_features)
    for lo in range(0, PILOT_ROWS, chunk):
        acts = model.sample_features(min(chunk, PILOT_ROWS - lo), gen)
        widest = max(widest, int((acts > 0).sum(1).max()))
    return min(model.num_features, 2 * widest + 16)


def write_synthetic_dataset(spark, config: SyntheticDataConfig) -> dict:
    """Draw ``config.rows`` samples of the model at ``config.model`` in Spark and write
    them to ``config.output`` (module docstring); returns ``{rows, partitions,
    max_active, output}``."""
    from pyspark.sql.types import (
        ArrayType,
        FloatType,
        IntegerType,
        LongType,
        StructField,
        StructType,
    )

    from ..spark.register import register
    from .synthetic import SyntheticModel

    model = SyntheticModel.load(_local(config.model))
    max_active = config.max_active or choose_max_active(model, config.seed)
    partitions = -(-config.rows // config.rows_per_partition)
    schema = StructType([
        StructField(ACTIVATION, ArrayType(FloatType(), False), False),
        StructField(FEATURE_INDICES, ArrayType(IntegerType(), False), False),
        StructField(FEATURE_VALUES, ArrayType(FloatType(), False), False),
        StructField(ROW, LongType(), False),
    ])  # fmt: skip
    metadata = {"synthetic_model": json.dumps(model.config.to_dict()),
                "synthetic_seed": str(config.seed), "max_active": str(max_active)}  # fmt: skip
    register(spark)
    (spark.range(0, partitions, 1, partitions)
     .mapInArrow(_task(config, max_active), schema)
     .write.format("safetensors")
     .option("batch_size", config.rows_per_shard)
     .option("metadata", json.dumps(metadata))
     .mode("overwrite").save(config.output))  # fmt: skip
    return {"rows": config.rows, "partitions": partitions, "max_active": max_active,
            "output": config.output}  # fmt: skip


def _local(path: str) -> str:
    from ..dataset.fetch import local_copy

    return local_copy(path, cache_dir=os.path.join(os.path.expanduser("~"), ".cache",
                                                   "pyspark_safetensors", "synthetic"))  # fmt: skip


def synthetic_datasets(spark, model_config, out_dir: str | os.PathLike, *, train_rows: int,
                       eval_rows: int, seed: int = 0, **options) -> dict[str, str]:  # fmt: skip
    """Build the model of ``model_config`` (a ``SyntheticModelConfig``), save it to
    ``out_dir/model`` and write ``out_dir/train`` (seed ``seed``) and ``out_dir/eval``
    (seed ``seed + 1``); ``options``: ``SyntheticDataConfig``'s other fields. Returns the
    three paths."""
    from .synthetic import SyntheticModel

    out = Path(out_dir)
    paths = {"model": str(out / "model"), "train": str(out / "train"), "eval": str(out / "eval")}
    SyntheticModel.build(model_config).save(paths["model"])
    for name, rows, s in (("train", train_rows, seed), ("eval", eval_rows, seed + 1)):
        write_synthetic_dataset(spark, SyntheticDataConfig(paths["model"], paths[name], rows,
                                                           seed=s, **options))  # fmt: skip
    return paths
