"""The extraction job: a text corpus in, activation datasets out, with the transformer
running inside Spark (``mapInArrow``; the model is loaded once per Python worker). Only
the DataFrame API is used, so the job runs on classic and Spark Connect sessions alike.

Output directory (published whole: everything is written under a staging name first):

    activations/{hook}/   token-level batch datasets: activation [B, H], sample_id,
                          token_pos, window
    samples/              sample-level KV dataset: key -> one [seq_len, H] per hook
    samples_zarr/         (zarr_run=True) the same samples as a Zarr sharded run: one
                          shard per Spark task, manifest.json written last by the driver
    samples.parquet       one row per model input: sample_id, window, key, seq_len,
                          text_chars, source
    texts.jsonl           sample_id, key, source, text
    extraction.json       the config, its hash, the summary
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from ..dataset import verify_dataset
from ..dataset.publish import publish, staging_path
from .corpus import corpus_sha256, default_parallelism, load_corpus, number_texts
from .model import ExtractionError, Extractor, ModelSource, resolve_model, weights_hash

TENSOR_STRUCT = "struct<data: binary, shape: array<int>, dtype: string>"
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
    out_dir: Path
    texts: int
    samples: int
    tokens: int
    bytes: int
    seconds: float
    config_hash: str
    hooks: dict[str, int] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)

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
    cols = ", ".join(f"`{h.column}` {TENSOR_STRUCT}" for h in hooks)
    return (
        "sample_id long, window int, key string, seq_len int, text_chars int, "
        f"source string, {cols}"
    )


def _run_model_fn(model: ModelSource, config: ExtractConfig, threads: int):
    """The function ``mapInArrow`` runs: texts in, one row per model input out."""

    def run(batches):
        extractor = _cached_extractor(str(model.local_dir()), config, threads)
        chunk = config.batch_size * 8  # bounds memory and the size of each output batch
        for big in batches:
            for offset in range(0, big.num_rows, chunk):
                yield _windows_batch(extractor, big.slice(offset, chunk), config.dtype)

    return run


def _windows_batch(extractor: Extractor, batch: pa.RecordBatch, dtype: str) -> pa.RecordBatch:
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
        arrays = [w.activations[hook.name] for w in windows]
        columns[hook.column] = pa.StructArray.from_arrays(
            [
                pa.array([a.tobytes() for a in arrays], pa.binary()),
                pa.array([list(a.shape) for a in arrays], pa.list_(pa.int32())),
                pa.repeat(pa.scalar(dtype), len(arrays)),
            ],
            names=["data", "shape", "dtype"],
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
    itemsize = {"F16": 2, "BF16": 2, "F32": 4}[dtype]
    row_bytes = width * itemsize

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
            activation = pa.StructArray.from_arrays(
                [token_data, shape, pa.repeat(pa.scalar(dtype), n)],
                names=["data", "shape", "dtype"],
            )
            sample_id = np.repeat(batch.column("sample_id").to_numpy(), seq_lens)
            window = np.repeat(batch.column("window").to_numpy(), seq_lens)
            firsts = np.repeat(np.cumsum(seq_lens) - seq_lens, seq_lens)
            token_pos = (np.arange(n) - firsts).astype(np.int32)
            yield pa.RecordBatch.from_pydict({
                "activation": activation,
                "sample_id": pa.array(sample_id),
                "token_pos": pa.array(token_pos),
                "window": pa.array(window.astype(np.int32)),
            })  # fmt: skip

    return explode


def _zarr_shard_fn(run_dir: str, hooks, width: int, config: ExtractConfig, attrs: dict):
    """The function each Spark task runs: its sample rows -> one Zarr shard written by one
    writer (published whole under the partition's name), one row per sample out."""

    def write(batches):
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
                    key = keys[row]
                    writer.add(
                        acts,
                        sample_key=key if len(key) <= 64 else hashlib.sha256(key.encode()).hexdigest(),
                        extra={"key": key, "sample_id": sids[row], "window": wins[row],
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

    return write


def _tensor(batch, column, row, n, width, dtype) -> np.ndarray:
    """One sample's ``[n, width]`` activations of one hook point, as stored in the row."""
    data = batch.column(column).field("data")[row].as_buffer()
    if dtype == "BF16":  # widen exactly; the store rounds to float16 (nearest even)
        bits = np.frombuffer(data, np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32).reshape(n, width)
    return np.frombuffer(data, np.float16 if dtype == "F16" else np.float32).reshape(n, width)


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


def run_extraction(
    spark,
    config: ExtractConfig,
    out_dir: str | os.PathLike,
    *,
    corpus=None,
    overwrite: bool = False,
) -> ExtractionSummary:
    """Run the job; see the module docstring for the outputs. Nothing appears at
    ``out_dir`` unless every part was written.

    ``spark``: a classic or a Spark Connect session. ``corpus``: a DataFrame with the text
    column ``config.text_column`` (and optionally ``source``) instead of
    ``config.corpus``; the config hash then names its texts by content."""
    from pyspark import StorageLevel

    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise ExtractionError(f"{out_dir} already exists; pass overwrite=True to replace it")
    if corpus is not None:
        if config.corpus != ExtractConfig.corpus:
            raise ExtractionError(
                f"corpus {config.corpus!r} in the config and a corpus DataFrame: give one"
            )
        config = dataclasses.replace(config, corpus="dataframe")
    model = resolve_model(config.model)
    model_dir = model.path
    # Validate the model and the hooks on the driver before any task starts.
    probe = _extractor(model_dir, config)
    widths = {h.name: w for h, w in zip(probe.hooks, probe.widths().values(), strict=True)}
    hooks = probe.hooks
    if config.zarr_run and len(set(widths.values())) != 1:
        raise ExtractionError(
            f"zarr_run needs hook points of one width (a store is (N, L, T_max, H)); got {widths}"
        )
    model_hash = weights_hash(model_dir)
    del probe

    corpus = load_corpus(spark, config, corpus)
    if config.max_texts:
        corpus = corpus.orderBy("key").limit(config.max_texts)
    cores = default_parallelism(spark)
    # sample_id: the text's rank by key, so ids do not depend on partitioning; stored
    # once: the model stage and texts.jsonl both read the texts
    texts, stored = number_texts(corpus, config.partitions or cores)
    threads = max(1, (os.cpu_count() or 1) // cores)

    staging = staging_path(out_dir)
    staging.mkdir(parents=True)
    samples = None
    try:
        started = time.perf_counter()
        samples = texts.mapInArrow(
            _run_model_fn(model, config, threads), _samples_schema(hooks)
        ).persist(StorageLevel.DISK_ONLY)
        n_samples = samples.count()  # runs the model (Spark's progress bar shows it)
        if n_samples == 0:
            raise ExtractionError(f"corpus {config.corpus!r} has no non-empty text")
        seconds = time.perf_counter() - started
        info = samples.select(
            "sample_id", "window", "key", "seq_len", "text_chars", "source"
        ).toArrow()
        tokens = int(pa.compute.sum(info.column("seq_len")).as_py())
        if config.corpus == "dataframe":  # name the texts by content
            keys = texts.select("key").toArrow().column("key").to_pylist()
            chash = config_hash(config, model_hash, corpus_sha256(keys))
        else:
            chash = config_hash(config, model_hash)
        tokenizer_settings = {"max_length": config.max_length, "long_texts": config.long_texts,
                              "padding": "excluded"}  # fmt: skip
        base_meta = {
            "model": model.name,
            "model_weights_sha256": model_hash,
            "dtype": config.dtype,
            "tokenizer": json.dumps(tokenizer_settings, sort_keys=True),
            "config_hash": chash,
            "corpus": config.corpus,
        }
        from pyspark.sql import functions as F

        for hook in hooks:
            tokens_df = samples.select("sample_id", "window", "seq_len", hook.column).mapInArrow(
                _explode_fn(hook.column, widths[hook.name], config.dtype),
                f"activation {TENSOR_STRUCT}, sample_id long, token_pos int, window int",
            )
            meta = {**base_meta, "hook_point": hook.name, "d_model": str(widths[hook.name])}
            (
                tokens_df.write.format("safetensors")
                .option("batch_size", config.rows_per_shard)
                .option("metadata", json.dumps(meta))
                .mode("overwrite")
                .save(str(staging / "activations" / hook.column))
            )
        if config.kv_dataset:
            kv_meta = {**base_meta, "hook_points": json.dumps([h.name for h in hooks])}
            (
                samples.select("key", *[F.col(h.column) for h in hooks])
                .write.format("safetensors")
                .option("name_col", "key")
                .option("metadata", json.dumps(kv_meta))
                .mode("overwrite")
                .save(str(staging / "samples"))
            )
        if config.zarr_run:
            zarr_meta = {**base_meta, "hook_points": [h.name for h in hooks]}
            write_zarr_run(samples, hooks, widths, config, staging / "samples_zarr", zarr_meta)
        import pyarrow.parquet as pq

        pq.write_table(info.sort_by("sample_id"), staging / "samples.parquet")
        with open(staging / "texts.jsonl", "w") as f:
            for row in (
                texts.select("sample_id", "key", "source", "text")
                .orderBy("sample_id")
                .toLocalIterator()
            ):
                f.write(json.dumps(row.asDict(), ensure_ascii=False) + "\n")
        size = sum(p.stat().st_size for p in staging.rglob("*") if p.is_file())
        summary = ExtractionSummary(
            out_dir, texts=len(info.column("sample_id").unique()), samples=n_samples,
            tokens=tokens, bytes=size, seconds=seconds, config_hash=chash, hooks=widths,
        )  # fmt: skip
        doc = {
            "config": config.to_dict(),
            "config_hash": chash,
            "model": model.name,
            "model_dir": model_dir,
            "model_revision": model.revision,
            "model_weights_sha256": model_hash,
            "hooks": {
                h.name: {
                    "dataset": f"activations/{h.column}",
                    "kv_column": h.column,
                    "width": widths[h.name],
                }
                for h in hooks
            },
            "summary": {
                "texts": summary.texts,
                "samples": n_samples,
                "tokens": tokens,
                "bytes": size,
                "seconds": seconds,
                "tokens_per_s": summary.tokens_per_s,
            },
        }
        (staging / "extraction.json").write_text(json.dumps(doc, indent=2) + "\n")
        for hook in hooks:
            verify_dataset(staging / "activations" / hook.column)
        publish(staging, out_dir)
        return summary
    finally:
        stored.unpersist()
        if samples is not None:
            samples.unpersist()
        shutil.rmtree(staging, ignore_errors=True)
