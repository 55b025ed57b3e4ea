"""The functions Spark's Python workers run for an extraction, and the row schemas they
produce. Each is built on the driver from picklable arguments and runs inside
``mapInArrow``; torch and transformers load in the workers (through ``Extractor``), once
per worker process.

- ``plan_fn``: loads the model in a worker (where it stays for the model stage) and
  returns what the driver plans with: the hook points, their widths, the tokens per
  input, whether a BOS is added (``MODEL_PLAN_SCHEMA``).
- ``count_fn``: texts in, the token rows they give out (the tokenizer alone).
- ``run_model_fn``: texts in, one row per model input out (``samples_schema``): the
  sample's key, ``seq_len``, ``first_pos`` (the model-input position of its first stored
  token: 1 when BOS is dropped), one Tensor Struct ``[seq_len, H]`` per hook point when
  the rows are stored, and ``task_commits``. Images in (an image corpus, numbered by
  ``images.number_images``): one row per image, every token, ``sample_id`` its
  ``image_id``, with ``images.IMAGE_COLUMNS`` (its label, size and thumbnail). It writes the outputs' stage writes
  (``outputs.StageWrite``) as it goes: what each dataset's task wrote comes back, pickled,
  in the ``task_commits`` of the partition's last row (null in every other row).
"""

from __future__ import annotations

import json
import pickle

import pyarrow as pa

from ..format import get_dtype
from .config import ExtractConfig
from .images import IMAGE_COLUMNS
from .model import ExtractionError, Extractor, ModelSource, bos_added

MODEL_BATCHES_PER_OUTPUT_BATCH = 8
"""Texts per ``mapInArrow`` output batch, in model batches: bounds a worker's memory."""
OUTPUT_BATCH_BYTES = 256 << 20
"""The activations of one output batch, at most (every hook point, each text's
``max_length`` tokens), in whole model batches but at least one: a task holds about three
output batches at once (the last one, which its datasets' open shards still view, and the
next one as the model's arrays and as Arrow), so a wide extraction (every layer's MLP of a
large model) takes fewer texts per output batch."""


SCALAR_COLUMNS = ("sample_id", "window", "key", "seq_len", "first_pos", "text_chars", "source")
"""What every sample row has, beside its activations."""

TASK_COMMITS = "task_commits"


def scalar_columns(config: ExtractConfig) -> tuple[str, ...]:
    """A sample row's columns beside its activations: ``SCALAR_COLUMNS``, and
    ``IMAGE_COLUMNS`` for an image."""
    return SCALAR_COLUMNS + (IMAGE_COLUMNS if config.modality == "image" else ())


def samples_schema(hooks, *, tensors: bool = True, images: bool = False) -> str:
    """The model stage's rows: the scalars (and an image's, with ``images``), one Tensor
    Struct per hook point (``tensors``) and ``task_commits``."""
    from ..spark.tensor_struct import TENSOR_STRUCT_DDL

    cols = "".join(f"`{h.column}` {TENSOR_STRUCT_DDL}, " for h in hooks) if tensors else ""
    image = "label string, width int, height int, thumbnail binary, " if images else ""
    return (
        "sample_id long, window int, key string, seq_len int, first_pos int, text_chars int, "
        f"source string, {image}{cols}{TASK_COMMITS} binary"
    )


MODEL_PLAN_SCHEMA = "plan string"
"""One JSON document per ``plan_fn`` task: the plan, or ``{"error": ...}``."""


def plan_fn(model: ModelSource, config: ExtractConfig, threads: int):
    """The function ``mapInArrow`` runs to plan an extraction: it loads the model as the
    model stage will (``threads`` torch threads; kept loaded in the worker for it) and
    returns one ``MODEL_PLAN_SCHEMA`` row: ``hooks`` ([module, where] pairs), ``widths``
    (by hook name), ``mlp_blocks`` ([layer, input module, output module] of each MLP
    ``mlp_layers`` named), ``max_length``, ``bos_added``. A bad model or hook point comes back as
    ``{"error": message}``, for the driver to raise as the ExtractionError it is."""

    def plan(batches):
        for _ in batches:  # the input's rows only say how many workers to warm
            pass
        try:
            extractor = _cached_extractor(str(model.local_dir()), config, threads)
            doc = {
                "hooks": [[h.module, h.where] for h in extractor.hooks],
                "widths": extractor.widths(),
                "mlp_blocks": [
                    [b.layer, b.input.module, b.output.module] for b in extractor.mlp_blocks
                ],
            }
            if config.modality == "image":
                layout = extractor.layout
                doc.update(max_length=layout.n_tokens, bos_added=False, image=layout.to_dict())
            else:
                doc.update(
                    max_length=extractor.max_length, bos_added=bos_added(extractor.tokenizer)
                )
        except ExtractionError as e:
            doc = {"error": str(e)}
        yield pa.RecordBatch.from_pydict({"plan": [json.dumps(doc)]})

    return plan


TOKEN_COUNT_SCHEMA = "tokens long"
"""One row per ``count_fn`` task: the token rows its texts give."""


def count_fn(model: ModelSource, config: ExtractConfig, threads: int):
    """The function ``mapInArrow`` runs to count the token rows of texts before the model
    runs on them (``Extractor.count_tokens``: the tokenizer of the worker's loaded model,
    as the model stage will tokenize them)."""

    def count(batches):
        extractor = _cached_extractor(str(model.local_dir()), config, threads)
        tokens = sum(extractor.count_tokens(b.column("text").to_pylist()) for b in batches)
        yield pa.RecordBatch.from_pydict({"tokens": pa.array([tokens], pa.int64())})

    return count


def run_model_fn(
    model: ModelSource, config: ExtractConfig, threads: int, writes=(), *, tensors: bool = True
):
    """The function ``mapInArrow`` runs: texts in, one row per model input out, each
    batch also handed to every stage write (``writes``); the activation columns are kept
    in the rows only with ``tensors``. The last row is held back until the writes have
    finished, to carry their ``TaskResult``s."""

    def run(batches):
        from pyspark import TaskContext

        extractor = _cached_extractor(str(model.local_dir()), config, threads)
        image = config.modality == "image"
        texts_per_batch = texts_per_output_batch(
            config.batch_size, extractor.layout.n_tokens if image else extractor.max_length,
            sum(extractor.widths().values()) * get_dtype(config.dtype).itemsize,
        )  # fmt: skip
        make_rows = _images_batch if image else _windows_batch
        scalars = list(scalar_columns(config))
        ctx = TaskContext.get()
        # a partition computed again after the commit (a lost stored block) writes nothing
        writers = [
            (w, w.job.partition(ctx.partitionId(), ctx.taskAttemptId()))
            for w in writes
            if w.job.live()
        ]
        held = None
        try:
            for big in batches:
                for offset in range(0, big.num_rows, texts_per_batch):
                    rows = make_rows(extractor, big.slice(offset, texts_per_batch), config.dtype)
                    if not rows.num_rows:
                        continue
                    for write, writer in writers:
                        writer.add(write.rows(rows))
                    if held is not None:
                        yield _with_commits(held, None)
                    held = rows if tensors else rows.select(scalars)
            results = [writer.finish() for _, writer in writers]
        except BaseException:
            for _, writer in writers:
                writer.discard()
            raise
        if held is not None:
            yield _with_commits(held, pickle.dumps(results) if writers else None)

    return run


def texts_per_output_batch(batch_size: int, tokens_per_text: int, bytes_per_token: int) -> int:
    """Texts per output batch: ``MODEL_BATCHES_PER_OUTPUT_BATCH`` model batches, fewer
    where their activations (``tokens_per_text`` tokens of ``bytes_per_token`` a text)
    would pass ``OUTPUT_BATCH_BYTES``; one model batch at least."""
    model_batch = max(1, batch_size * tokens_per_text * bytes_per_token)
    fit = OUTPUT_BATCH_BYTES // model_batch
    return batch_size * max(1, min(MODEL_BATCHES_PER_OUTPUT_BATCH, fit))


def _with_commits(rows: pa.RecordBatch, commits: bytes | None) -> pa.RecordBatch:
    """``rows`` with ``task_commits``: ``commits`` in the last row, null in the others."""
    column = pa.array([None] * (rows.num_rows - 1) + [commits], pa.binary())
    return rows.append_column(TASK_COMMITS, column)


def task_results(commits: pa.ChunkedArray, writes: int) -> list[list]:
    """The ``TaskResult``s of each of ``writes`` stage writes, from the ``task_commits``
    column of the whole stage."""
    results = [[] for _ in range(writes)]
    for blob in commits.drop_null().to_pylist():
        for i, result in enumerate(pickle.loads(blob)):
            results[i].append(result)
    return results


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


def _images_batch(extractor, batch: pa.RecordBatch, dtype: str) -> pa.RecordBatch:
    """One sample row per image of ``batch`` (numbered, checked images): every token."""
    from ..spark.tensor_struct import tensor_structs_of_arrays
    from .vision import decode_image

    paths = batch.column("path").to_pylist()
    contents = batch.column("content")
    acts, thumbnails = [], []
    # decoded one model batch at a time: a photo decodes to many times its file's size
    for start in range(0, batch.num_rows, extractor.batch_size):
        images = []
        chunk = contents.slice(start, extractor.batch_size).to_pylist()
        for path, data in zip(paths[start : start + len(chunk)], chunk, strict=True):
            try:
                images.append(decode_image(data))
            except Exception as e:  # read whole by the check pass: a file changed since
                raise ExtractionError(f"image {path} can no longer be read ({e})") from e
        batch_acts, batch_thumbnails = extractor.run(images, thumbnails=True)
        acts += batch_acts
        thumbnails += batch_thumbnails
    n, tokens = batch.num_rows, extractor.layout.n_tokens
    columns = {
        "sample_id": batch.column("image_id"),
        "window": pa.array([0] * n, pa.int32()),
        "key": batch.column("key"),
        "seq_len": pa.array([tokens] * n, pa.int32()),
        "first_pos": pa.array([0] * n, pa.int32()),
        "text_chars": pa.array([0] * n, pa.int32()),
        "source": batch.column("path"),
        "label": batch.column("label"),
        "width": batch.column("width"),
        "height": batch.column("height"),
        "thumbnail": pa.array(thumbnails, pa.binary()),
    }
    for hook in extractor.hooks:
        columns[hook.column] = tensor_structs_of_arrays([a[hook.name] for a in acts], dtype)
    return pa.RecordBatch.from_pydict(columns)


def extractor_for(model_dir: str, config: ExtractConfig, threads: int = 0):
    """The model of an extraction: a ``VisionExtractor`` for an image corpus, else an
    ``Extractor``."""
    if config.modality == "image":
        from .vision import VisionExtractor

        return VisionExtractor(
            model_dir, list(config.hooks), batch_size=config.batch_size, dtype=config.dtype,
            threads=threads, mlp_layers=config.mlp_layers,
        )  # fmt: skip
    return Extractor(
        model_dir,
        list(config.hooks),
        max_length=config.max_length,
        batch_size=config.batch_size,
        dtype=config.dtype,
        long_texts=config.long_texts,
        threads=threads,
        keep_bos=config.keep_bos,
        mlp_layers=config.mlp_layers,
    )


_EXTRACTORS: dict = {}


def _cached_extractor(model_dir: str, config: ExtractConfig, threads: int):
    """One model per Python worker process (Spark reuses workers between tasks), kept
    while the next extraction asks for the same model the same way (the fields the
    extractor reads; not the corpus or the outputs)."""
    key = (model_dir, threads, config.modality, config.hooks, config.batch_size, config.dtype,
           config.max_length, config.long_texts, config.keep_bos, config.mlp_layers)  # fmt: skip
    if key not in _EXTRACTORS:
        _EXTRACTORS.clear()
        _EXTRACTORS[key] = extractor_for(model_dir, config, threads)
    return _EXTRACTORS[key]
