"""The functions Spark's Python workers run for an extraction, and the row schemas they
produce. Each is built on the driver from picklable arguments and runs inside
``mapInArrow``; torch and transformers load in the workers (through ``Extractor``), once
per worker process.

- ``plan_fn``: loads the model in a worker (where it stays for the model stage) and
  returns what the driver plans with: the hook points, their widths, the tokens per
  input, whether a BOS is added (``MODEL_PLAN_SCHEMA``).
- ``run_model_fn``: texts in, one row per model input out (``samples_schema``): the
  sample's key, ``seq_len``, ``first_pos`` (the model-input position of its first stored
  token: 1 when BOS is dropped) and one Tensor Struct ``[seq_len, H]`` per hook point.
- ``explode_fn``: sample rows in, one row per token out (``TOKEN_ROWS_SCHEMA``), without
  copying the activation bytes.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa

from ..format import get_dtype
from .config import ExtractConfig
from .model import ExtractionError, Extractor, ModelSource, bos_added

MODEL_BATCHES_PER_OUTPUT_BATCH = 8
"""Texts per ``mapInArrow`` output batch, in model batches: bounds a worker's memory."""


def token_rows_schema() -> str:
    """The DDL of ``explode_fn``'s rows: one token's activation, its sample and position."""
    from ..spark.tensor_struct import TENSOR_STRUCT_DDL

    return f"activation {TENSOR_STRUCT_DDL}, sample_id long, token_pos int, window int"


def samples_schema(hooks) -> str:
    from ..spark.tensor_struct import TENSOR_STRUCT_DDL

    cols = ", ".join(f"`{h.column}` {TENSOR_STRUCT_DDL}" for h in hooks)
    return (
        "sample_id long, window int, key string, seq_len int, first_pos int, text_chars int, "
        f"source string, {cols}"
    )


MODEL_PLAN_SCHEMA = "plan string"
"""One JSON document per ``plan_fn`` task: the plan, or ``{"error": ...}``."""


def plan_fn(model: ModelSource, config: ExtractConfig, threads: int):
    """The function ``mapInArrow`` runs to plan an extraction: it loads the model as the
    model stage will (``threads`` torch threads; kept loaded in the worker for it) and
    returns one ``MODEL_PLAN_SCHEMA`` row: ``hooks`` ([module, where] pairs), ``widths``
    (by hook name), ``max_length``, ``bos_added``. A bad model or hook point comes back as
    ``{"error": message}``, for the driver to raise as the ExtractionError it is."""

    def plan(batches):
        for _ in batches:  # the input's rows only say how many workers to warm
            pass
        try:
            extractor = _cached_extractor(str(model.local_dir()), config, threads)
            doc = {
                "hooks": [[h.module, h.where] for h in extractor.hooks],
                "widths": extractor.widths(),
                "max_length": extractor.max_length,
                "bos_added": bos_added(extractor.tokenizer),
            }
        except ExtractionError as e:
            doc = {"error": str(e)}
        yield pa.RecordBatch.from_pydict({"plan": [json.dumps(doc)]})

    return plan


def run_model_fn(model: ModelSource, config: ExtractConfig, threads: int):
    """The function ``mapInArrow`` runs: texts in, one row per model input out."""

    def run(batches):
        extractor = _cached_extractor(str(model.local_dir()), config, threads)
        texts_per_batch = config.batch_size * MODEL_BATCHES_PER_OUTPUT_BATCH
        for big in batches:
            for offset in range(0, big.num_rows, texts_per_batch):
                yield _windows_batch(extractor, big.slice(offset, texts_per_batch), config.dtype)

    return run


def _windows_batch(extractor: Extractor, batch: pa.RecordBatch, dtype: str) -> pa.RecordBatch:
    from ..spark.tensor_struct import tensor_structs_of_arrays

    texts = batch.column("text").to_pylist()
    windows = extractor.run(texts)
    ids = batch.column("sample_id").to_numpy()
    keys = batch.column("key").to_pylist()
    sources = batch.column("source").to_pylist()
    multi = {w.text_index for w in windows if w.window > 0}
    columns = {
        "sample_id": pa.array([int(ids[w.text_index]) for w in windows], pa.int64()),
        "window": pa.array([w.window for w in windows], pa.int32()),
        "key": pa.array(
            [
                keys[w.text_index] + (f"-w{w.window}" if w.text_index in multi else "")
                for w in windows
            ],
            pa.string(),
        ),
        "seq_len": pa.array([w.seq_len for w in windows], pa.int32()),
        "first_pos": pa.array([w.first_pos for w in windows], pa.int32()),
        "text_chars": pa.array([len(texts[w.text_index]) for w in windows], pa.int32()),
        "source": pa.array([sources[w.text_index] for w in windows], pa.string()),
    }
    for hook in extractor.hooks:
        columns[hook.column] = tensor_structs_of_arrays(
            [w.activations[hook.name] for w in windows], dtype
        )
    return pa.RecordBatch.from_pydict(columns)


def extractor_for(model_dir: str, config: ExtractConfig, threads: int = 0) -> Extractor:
    return Extractor(
        model_dir,
        list(config.hooks),
        max_length=config.max_length,
        batch_size=config.batch_size,
        dtype=config.dtype,
        long_texts=config.long_texts,
        threads=threads,
        keep_bos=config.keep_bos,
    )


_EXTRACTORS: dict = {}


def _cached_extractor(model_dir: str, config: ExtractConfig, threads: int) -> Extractor:
    """One model per Python worker process (Spark reuses workers between tasks)."""
    key = (model_dir, config, threads)  # the config is frozen, hence hashable
    if key not in _EXTRACTORS:
        _EXTRACTORS.clear()
        _EXTRACTORS[key] = extractor_for(model_dir, config, threads)
    return _EXTRACTORS[key]


def explode_fn(column: str, width: int, dtype: str):
    """Sample rows ``[seq_len, H]`` -> one row per token, without copying the bytes: the
    samples' data buffers already hold the tokens back to back."""
    from ..spark.tensor_struct import assemble_tensor_structs

    row_bytes = width * get_dtype(dtype).itemsize

    def explode(batches):
        for batch in batches:
            data = batch.column(column).flatten()[0]  # children cut to the parent's slice
            seq_lens = batch.column("seq_len").to_numpy().astype(np.int64)
            n = int(seq_lens.sum())
            wide = pa.types.is_large_binary(data.type)
            offsets = np.frombuffer(data.buffers()[1], np.int64 if wide else np.int32)
            offsets = offsets[data.offset : data.offset + len(data) + 1].astype(np.int64)
            if offsets[-1] - offsets[0] != n * row_bytes:
                raise ExtractionError(f"{column}: sample bytes do not match seq_len x {width}")
            values = data.buffers()[2]
            token_offsets = pa.py_buffer(
                (offsets[0] + np.arange(n + 1, dtype=np.int64) * row_bytes).astype(
                    np.int64 if wide else np.int32
                )
            )
            token_data = pa.Array.from_buffers(data.type, n, [None, token_offsets, values])
            shape = pa.ListArray.from_arrays(
                pa.array(np.arange(n + 1, dtype=np.int32)), pa.array(np.full(n, width, np.int32))
            )
            sample_id = np.repeat(batch.column("sample_id").to_numpy(), seq_lens)
            window = np.repeat(batch.column("window").to_numpy(), seq_lens)
            firsts = np.repeat(np.cumsum(seq_lens) - seq_lens, seq_lens)
            # the position in the model input: a dropped BOS shifts the stored tokens by one
            shift = np.repeat(batch.column("first_pos").to_numpy().astype(np.int64), seq_lens)
            token_pos = (np.arange(n) - firsts + shift).astype(np.int32)
            yield pa.RecordBatch.from_pydict({
                "activation": assemble_tensor_structs(token_data, shape, dtype),
                "sample_id": pa.array(sample_id),
                "token_pos": pa.array(token_pos),
                "window": pa.array(window.astype(np.int32)),
            })  # fmt: skip

    return explode
