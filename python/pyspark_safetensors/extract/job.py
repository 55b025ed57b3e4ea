"""The extraction job: a text corpus in, activation datasets out, with the transformer
running inside Spark (``mapInArrow``; the model is loaded once per Python worker). Only
the DataFrame API is used, so the job runs on classic and Spark Connect sessions alike.

Output directory (a local path or a URI such as ``s3://bucket/acts``):

    activations/{hook}/   token-level batch datasets: activation [B, H], sample_id,
                          token_pos, window
    samples/              sample-level KV dataset: key -> one [seq_len, H] per hook
    samples_zarr/         (zarr_run=True, local output only) the same samples as a Zarr
                          sharded run: one shard per Spark task, manifest.json written
                          last by the driver
    samples.parquet       one row per model input: sample_id, window, key, seq_len,
                          text_chars, source
    texts.jsonl           sample_id, key, source, text
    extraction.json       the config, its hash, the summary; written last, so its
                          presence marks a finished extraction

A local output is built under a staging name and published whole (one rename). An
object store has no rename: each dataset is committed in place by its own manifest, and
``extraction.json`` is put last.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs

from ..dataset import DatasetLocation
from ..dataset.publish import publishing
from ..format import get_dtype
from .corpus import corpus_sha256, default_parallelism, load_corpus, number_texts
from .model import (
    ExtractionError,
    Extractor,
    Hook,
    ModelSource,
    resolve_model,
    weights_hash,
)

EXTRACTION_DOC = "extraction.json"
"""Written last: its presence marks a finished extraction."""
MODEL_BATCHES_PER_OUTPUT_BATCH = 8
"""Texts per ``mapInArrow`` output batch, in model batches: bounds a worker's memory."""
SHORTEST_SECONDS = 1e-9
"""A duration too short to measure counts as this, so rates stay finite."""
MAX_ZARR_SAMPLE_KEY = 64
"""The longest ``sample_key`` a Zarr store takes; longer keys are stored as their sha256."""
DEFAULT_HOOKS = (
    "encoder.layer.0.attention.self.query:input",
    "encoder.layer.0.intermediate.dense:input",
)


@dataclass(frozen=True)
class ExtractConfig:
    corpus: str = "demo"
    """"demo" (Python's pydoc_data.topics in passages), a directory of text files, or a
    parquet/JSON table path with a ``text`` column (``text_column``). A DataFrame corpus
    is passed to ``run_extraction`` instead."""
    text_column: str = "text"
    model: str = ""
    """A Hugging Face model id (``org/name[@revision]``, found in the local Hugging Face
    cache, ``HF_HUB_CACHE``; fetched only when missing there and ``HF_HUB_OFFLINE`` is
    not set) or a local model directory; empty = the packaged all-MiniLM-L6-v2."""
    model_dir: str = ""
    """The former name of ``model`` (a local directory or a model id); set one of them."""
    hooks: tuple[str, ...] = DEFAULT_HOOKS
    """Module globs with ":input" (the input of e.g. a linear layer) or ":output"."""
    max_length: int = 128
    long_texts: str = "window"
    """Texts over ``max_length`` tokens: "window" (consecutive windows) or "truncate"."""
    batch_size: int = 32
    dtype: str = "F16"
    rows_per_shard: int = 16384
    """Tokens per shard of the token-level datasets."""
    partitions: int = 0
    """Spark partitions of the corpus; 0 = the session's default parallelism."""
    passage_chars: int = 400
    """Passage size of the demo corpus."""
    max_texts: int = 0
    """Use only the first N texts (by key); 0 = all."""
    kv_dataset: bool = True
    zarr_run: bool = False
    """Also write the samples as a Zarr sharded run (``samples_zarr/``: each Spark task
    one writer of ``shards/shard-XXXX.zarr``, layers = hook points in order, T_max =
    ``max_length``); needs the ``interop`` extra (zarr) and hook points of one width."""

    def __post_init__(self):
        if self.model_dir:  # one home for the model: fold the former name into ``model``
            if self.model and self.model != self.model_dir:
                raise ExtractionError(
                    f"model {self.model!r} and model_dir {self.model_dir!r} disagree; set model only"
                )
            object.__setattr__(self, "model", self.model_dir)
            object.__setattr__(self, "model_dir", "")

    def to_dict(self) -> dict:
        body = {**dataclasses.asdict(self), "hooks": list(self.hooks)}
        body.pop("model_dir")  # always folded into model
        return body


@dataclass
class ExtractionSummary:
    out_dir: Path | str
    """The output: a local directory, or the URI it was written to."""
    texts: int
    samples: int
    tokens: int
    bytes: int
    seconds: float
    config_hash: str
    hooks: dict[str, int] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, SHORTEST_SECONDS)

    def __str__(self) -> str:
        return (
            f"{self.texts:,} texts -> {self.samples:,} model inputs, {self.tokens:,} tokens, "
            f"{len(self.hooks)} hook point(s), {self.bytes / 1e9:.3f} GB in {self.seconds:.1f} s "
            f"({self.tokens_per_s:,.0f} tokens/s)"
        )


def config_hash(config: ExtractConfig, model_hash: str, corpus_hash: str = "") -> str:
    """sha256 of the canonical JSON of everything that determines the activations;
    ``corpus_hash`` (``corpus.corpus_sha256``) names the texts of a DataFrame corpus."""
    body = {**config.to_dict(), "model_weights_sha256": model_hash}
    if corpus_hash:
        body["corpus_sha256"] = corpus_hash
    body.pop("partitions")  # the layout of the work does not change the data
    body.pop("zarr_run")  # nor does a second copy of the samples
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _samples_schema(hooks) -> str:
    from ..spark.tensor_struct import TENSOR_STRUCT_DDL

    cols = ", ".join(f"`{h.column}` {TENSOR_STRUCT_DDL}" for h in hooks)
    return (
        "sample_id long, window int, key string, seq_len int, text_chars int, "
        f"source string, {cols}"
    )


def _run_model_fn(model: ModelSource, config: ExtractConfig, threads: int):
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
        "text_chars": pa.array([len(texts[w.text_index]) for w in windows], pa.int32()),
        "source": pa.array([sources[w.text_index] for w in windows], pa.string()),
    }
    for hook in extractor.hooks:
        columns[hook.column] = tensor_structs_of_arrays(
            [w.activations[hook.name] for w in windows], dtype
        )
    return pa.RecordBatch.from_pydict(columns)


def _extractor(model_dir: str, config: ExtractConfig, threads: int = 0) -> Extractor:
    return Extractor(
        model_dir,
        list(config.hooks),
        max_length=config.max_length,
        batch_size=config.batch_size,
        dtype=config.dtype,
        long_texts=config.long_texts,
        threads=threads,
    )


_EXTRACTORS: dict = {}


def _cached_extractor(model_dir: str, config: ExtractConfig, threads: int) -> Extractor:
    """One model per Python worker process (Spark reuses workers between tasks)."""
    key = (model_dir, config, threads)  # the config is frozen, hence hashable
    if key not in _EXTRACTORS:
        _EXTRACTORS.clear()
        _EXTRACTORS[key] = _extractor(model_dir, config, threads)
    return _EXTRACTORS[key]


def _explode_fn(column: str, width: int, dtype: str):
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
            token_pos = (np.arange(n) - firsts).astype(np.int32)
            yield pa.RecordBatch.from_pydict({
                "activation": assemble_tensor_structs(token_data, shape, dtype),
                "sample_id": pa.array(sample_id),
                "token_pos": pa.array(token_pos),
                "window": pa.array(window.astype(np.int32)),
            })  # fmt: skip

    return explode


def _zarr_shard_fn(run_dir: str, hooks, width: int, config: ExtractConfig, attrs: dict):
    """The function each Spark task runs: its sample rows -> one Zarr shard written by one
    writer (published whole under the partition's name), one row per sample out."""

    def write_partition_shard(batches):
        from pyspark import TaskContext

        from ..interop.zarr import StoreWriter, shard_path

        shard_id = TaskContext.get().partitionId()
        writer, ids, windows = None, [], []
        try:
            for batch in batches:
                if writer is None and batch.num_rows:
                    writer = StoreWriter(
                        Path(run_dir) / shard_path(shard_id), num_layers=len(hooks),
                        hidden_size=width, t_max=config.max_length,
                        model_id=attrs["model"], attrs=attrs,
                    )  # fmt: skip
                seq_lens = batch.column("seq_len").to_pylist()
                keys, sources = batch.column("key").to_pylist(), batch.column("source").to_pylist()
                sids, wins = (
                    batch.column("sample_id").to_pylist(),
                    batch.column("window").to_pylist(),
                )
                for row, n in enumerate(seq_lens):
                    acts = np.stack([_tensor(batch, h.column, row, n, width, config.dtype)
                                     for h in hooks])  # fmt: skip
                    writer.add(
                        acts,
                        sample_key=_zarr_sample_key(keys[row]),
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


def _zarr_sample_key(key: str) -> str:
    if len(key) <= MAX_ZARR_SAMPLE_KEY:
        return key
    return hashlib.sha256(key.encode()).hexdigest()


def _tensor(batch, column, row, n, width, dtype) -> np.ndarray:
    """One sample's ``[n, width]`` activations of one hook point, as stored in the row."""
    data = batch.column(column).field("data")[row].as_buffer()
    values = np.frombuffer(data, get_dtype(dtype).numpy).reshape(n, width)
    # bfloat16 widens exactly; the store rounds to float16 (nearest even)
    return values.astype(np.float32) if dtype == "BF16" else values


def write_zarr_run(samples, hooks, widths: dict, config: ExtractConfig, run_dir: Path, attrs):
    """The sample rows as a Zarr sharded run at ``run_dir``: each Spark task writes its
    partition as one shard; the driver then numbers the samples by (sample_id, window)
    and writes ``manifest.json`` last."""
    from ..interop.zarr import write_run_manifest

    width = next(iter(widths.values()))
    placed = (
        samples.select(
            "sample_id", "window", "key", "seq_len", "source", *[h.column for h in hooks]
        )
        .mapInArrow(
            _zarr_shard_fn(str(run_dir), hooks, width, config, attrs),
            "shard_id int, local_index int, sample_id long, window int",
        )
        .toArrow()
        .sort_by([("sample_id", "ascending"), ("window", "ascending")])
    )
    placement = list(
        zip(placed.column("shard_id").to_pylist(), placed.column("local_index").to_pylist(),
            strict=True)
    )  # fmt: skip
    write_run_manifest(run_dir, placement)


# -- the job, step by step -------------------------------------------------------------------


@dataclass(frozen=True)
class _ModelPlan:
    """The model and its hook points, checked on the driver before any task starts."""

    source: ModelSource
    hooks: tuple[Hook, ...]
    widths: dict[str, int]
    """Hidden width by hook name."""
    weights_sha256: str


@dataclass(frozen=True)
class _ModelRun:
    """The model's output: one persisted row per model input, and what it adds up to."""

    samples: object
    """The persisted sample rows (a DataFrame; the caller unpersists it)."""
    info: pa.Table
    """sample_id, window, key, seq_len, text_chars, source of every row."""
    seconds: float

    @property
    def tokens(self) -> int:
        return int(pc.sum(self.info.column("seq_len")).as_py())


def run_extraction(
    spark,
    config: ExtractConfig,
    out_dir: str | os.PathLike,
    *,
    corpus=None,
    overwrite: bool = False,
    storage_options: Mapping[str, str] | None = None,
) -> ExtractionSummary:
    """Run the job; see the module docstring for the outputs. A reader never takes a
    partial output for a finished one: a local ``out_dir`` appears whole or not at all; on
    an object store ``extraction.json`` appears last (after deleting the previous
    extraction, with ``overwrite=True``), and a failed job deletes what it wrote.

    ``spark``: a classic or a Spark Connect session. ``out_dir``: a local path or a URI
    (``s3://bucket/acts``, ``gs://``, ``abfss://``, ...; see ``DatasetLocation.of``).
    ``corpus``: a DataFrame with the text column ``config.text_column`` (and optionally
    ``source``) instead of ``config.corpus``; the config hash then names its texts by
    content. ``storage_options``: for a URI, e.g. ``{"endpoint_url": ...}`` (the
    writer's storage options; the usual ``AWS_*`` variables otherwise)."""
    target = DatasetLocation.of(out_dir, storage_options=storage_options)
    local = isinstance(target.fs, pafs.LocalFileSystem)
    _check_target(target, local, config, overwrite)
    if corpus is not None:
        if config.corpus != ExtractConfig.corpus:
            raise ExtractionError(
                f"corpus {config.corpus!r} in the config and a corpus DataFrame: give one"
            )
        config = dataclasses.replace(config, corpus="dataframe")
    plan = _plan_model(config)
    cores = default_parallelism(spark)
    texts, stored = _numbered_texts(spark, config, corpus, config.partitions or cores)
    run = None
    try:
        run = _run_model(texts, plan, config, threads=max(1, (os.cpu_count() or 1) // cores))
        chash = _config_hash(config, plan, texts)
        write = _OutputWriter(
            config, plan, run, texts, chash, dict(storage_options or {}) if not local else {}
        )
        if local:
            with publishing(target.root) as staging:
                summary = write(DatasetLocation.of(staging))
            return dataclasses.replace(summary, out_dir=Path(target.root))
        return _write_in_place(target, write)
    finally:
        stored.unpersist()
        if run is not None:
            run.samples.unpersist()


def _check_target(target: DatasetLocation, local: bool, config: ExtractConfig, overwrite: bool):
    exists = os.path.exists(target.root) if local else target.exists()
    if exists and not overwrite:
        raise ExtractionError(f"{target} already exists; pass overwrite=True to replace it")
    if config.zarr_run and not local:
        raise ExtractionError(
            f"zarr_run writes its Zarr stores to a local directory, not to {target}; "
            "extract to a local path, or leave zarr_run off and convert the samples "
            "dataset later (pyspark-safetensors convert)"
        )


def _plan_model(config: ExtractConfig) -> _ModelPlan:
    """Load the model once on the driver: a bad model or hook point fails before any task."""
    source = resolve_model(config.model)
    probe = _extractor(source.path, config)
    widths = {h.name: w for h, w in zip(probe.hooks, probe.widths().values(), strict=True)}
    if config.zarr_run and len(set(widths.values())) != 1:
        raise ExtractionError(
            f"zarr_run needs hook points of one width (a store is (N, L, T_max, H)); got {widths}"
        )
    return _ModelPlan(source, tuple(probe.hooks), widths, weights_hash(source.path))


def _numbered_texts(spark, config: ExtractConfig, corpus, partitions: int):
    """(texts numbered by key, the stored rows to unpersist): see ``number_texts``."""
    texts = load_corpus(spark, config, corpus)
    if config.max_texts:
        texts = texts.orderBy("key").limit(config.max_texts)
    # sample_id: the text's rank by key, so ids do not depend on partitioning; stored
    # once: the model stage and texts.jsonl both read the texts
    return number_texts(texts, partitions)


def _run_model(texts, plan: _ModelPlan, config: ExtractConfig, *, threads: int) -> _ModelRun:
    """Run the model over every text (Spark's progress bar shows it), ``threads`` torch
    threads per worker; the sample rows are persisted on disk: every output reads them."""
    from pyspark import StorageLevel

    started = time.perf_counter()
    samples = texts.mapInArrow(
        _run_model_fn(plan.source, config, threads), _samples_schema(plan.hooks)
    ).persist(StorageLevel.DISK_ONLY)
    try:
        if samples.count() == 0:
            raise ExtractionError(f"corpus {config.corpus!r} has no non-empty text")
        seconds = time.perf_counter() - started
        info = samples.select("sample_id", "window", "key", "seq_len", "text_chars", "source")
        return _ModelRun(samples, info.toArrow(), seconds)
    except BaseException:
        samples.unpersist()
        raise


def _config_hash(config: ExtractConfig, plan: _ModelPlan, texts) -> str:
    if config.corpus == "dataframe":  # name the texts by content
        keys = texts.select("key").toArrow().column("key").to_pylist()
        return config_hash(config, plan.weights_sha256, corpus_sha256(keys))
    return config_hash(config, plan.weights_sha256)


@dataclass
class _OutputWriter:
    """Writes every output of one extraction into a location, ``extraction.json`` last."""

    config: ExtractConfig
    plan: _ModelPlan
    run: _ModelRun
    texts: object
    """The numbered texts (a DataFrame)."""
    config_hash: str
    storage_options: dict[str, str]
    """Passed to the Spark writer as data-source options (empty for a local output)."""

    def __call__(self, out: DatasetLocation) -> ExtractionSummary:
        hooks = self.plan.hooks
        for hook in hooks:
            self._token_dataset(out, hook)
        if self.config.kv_dataset:
            self._save(
                self.run.samples.select("key", *[h.column for h in hooks]).write.option(
                    "name_col", "key"
                ),
                {"hook_points": json.dumps([h.name for h in hooks])},
                out.display("samples"),
            )
        if self.config.zarr_run:  # a local output only (checked up front)
            attrs = {**self._base_metadata(), "hook_points": [h.name for h in hooks]}
            run_dir = Path(out.local_file("samples_zarr"))
            write_zarr_run(self.run.samples, hooks, self.plan.widths, self.config, run_dir, attrs)
        self._tables(out)
        for hook in hooks:  # each dataset whole before the extraction is marked finished
            self._location(out, _token_dataset_name(hook)).verify()
        summary = self._summary(out)
        out.put_json(EXTRACTION_DOC, self._extraction_doc(summary))  # last: marks it finished
        return summary

    def _base_metadata(self) -> dict[str, str]:
        """What every dataset's manifest metadata says about the extraction."""
        config = self.config
        tokenizer_settings = {"max_length": config.max_length, "long_texts": config.long_texts,
                              "padding": "excluded"}  # fmt: skip
        return {
            "model": self.plan.source.name,
            "model_weights_sha256": self.plan.weights_sha256,
            "dtype": config.dtype,
            "tokenizer": json.dumps(tokenizer_settings, sort_keys=True),
            "config_hash": self.config_hash,
            "corpus": config.corpus,
        }

    def _save(self, writer, metadata: dict[str, str], uri: str) -> None:
        """One dataset through the Spark writer (its commit is atomic on any storage)."""
        (
            writer.format("safetensors")
            .options(**self.storage_options)
            .option("metadata", json.dumps({**self._base_metadata(), **metadata}))
            .mode("overwrite")
            .save(uri)
        )

    def _token_dataset(self, out: DatasetLocation, hook: Hook) -> None:
        from ..spark.tensor_struct import TENSOR_STRUCT_DDL

        width = self.plan.widths[hook.name]
        tokens = self.run.samples.select("sample_id", "window", "seq_len", hook.column).mapInArrow(
            _explode_fn(hook.column, width, self.config.dtype),
            f"activation {TENSOR_STRUCT_DDL}, sample_id long, token_pos int, window int",
        )
        self._save(
            tokens.write.option("batch_size", self.config.rows_per_shard),
            {"hook_point": hook.name, "d_model": str(width)},
            out.display(_token_dataset_name(hook)),
        )

    def _tables(self, out: DatasetLocation) -> None:
        """samples.parquet and texts.jsonl, each written to a local file first (locally the
        output's own; elsewhere a spool file uploaded in one stream: the texts may not fit
        in memory)."""
        import pyarrow.parquet as pq

        info = self.run.info.sort_by("sample_id")
        out.write_shard("samples.parquet", lambda path: pq.write_table(info, path))
        out.write_shard("texts.jsonl", self._write_texts)

    def _write_texts(self, path: str) -> None:
        rows = self.texts.select("sample_id", "key", "source", "text").orderBy("sample_id")
        with open(path, "w") as f:
            for row in rows.toLocalIterator():
                f.write(json.dumps(row.asDict(), ensure_ascii=False) + "\n")

    def _location(self, out: DatasetLocation, name: str) -> DatasetLocation:
        return DatasetLocation.of(out.display(name), storage_options=self.storage_options)

    def _summary(self, out: DatasetLocation) -> ExtractionSummary:
        files = out.list(recursive=True).values()
        return ExtractionSummary(
            Path(out.root) if out.local_file(EXTRACTION_DOC) else out.uri,
            texts=len(self.run.info.column("sample_id").unique()),
            samples=self.run.info.num_rows,
            tokens=self.run.tokens,
            bytes=sum(i.size for i in files if i.type == pafs.FileType.File),
            seconds=self.run.seconds,
            config_hash=self.config_hash,
            hooks=dict(self.plan.widths),
        )

    def _extraction_doc(self, summary: ExtractionSummary) -> dict:
        source, widths = self.plan.source, self.plan.widths
        return {
            "config": self.config.to_dict(),
            "config_hash": self.config_hash,
            "model": source.name,
            "model_dir": source.path,
            "model_revision": source.revision,
            "model_weights_sha256": self.plan.weights_sha256,
            "hooks": {
                h.name: {
                    "dataset": _token_dataset_name(h),
                    "kv_column": h.column,
                    "width": widths[h.name],
                }
                for h in self.plan.hooks
            },
            "summary": {
                "texts": summary.texts,
                "samples": summary.samples,
                "tokens": summary.tokens,
                "bytes": summary.bytes,
                "seconds": summary.seconds,
                "tokens_per_s": summary.tokens_per_s,
            },
        }


def _token_dataset_name(hook: Hook) -> str:
    return f"activations/{hook.column}"


def _write_in_place(target: DatasetLocation, write: _OutputWriter) -> ExtractionSummary:
    """An extraction straight into an object store (no rename there): the previous one's
    ``extraction.json`` is deleted first, so it stops looking finished, then the rest of
    it; ``write`` puts the new ``extraction.json`` last. A failure deletes what was written."""
    target.delete([EXTRACTION_DOC])
    target.delete(list(target.list()))
    try:
        return write(target)
    except BaseException:
        target.delete(list(target.list()))
        target.remove_if_empty()
        raise
