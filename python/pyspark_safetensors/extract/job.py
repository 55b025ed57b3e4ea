"""The extraction job: a text or image corpus in, activation datasets out, with the
transformer running inside Spark (``mapInArrow``; the model is loaded once per Python worker). Only
the DataFrame API is used, so the job runs on classic and Spark Connect sessions alike.

Output directory (a local path or a URI such as ``s3://bucket/acts``):

    activations/{hook}/   token-level batch datasets: activation [B, H], sample_id,
                          token_pos, window
                          (images: image_id, patch_row, patch_col, token_kind, layer)
    samples/              sample-level KV dataset: key -> one [seq_len, H] per hook
    samples_zarr/         (zarr_run=True, local output only) the same samples as a Zarr
                          sharded run: one shard per Spark task, manifest.json written
                          last by the driver
    samples.parquet       one row per model input: sample_id, window, key, seq_len,
                          first_pos, text_chars, source
    texts.jsonl           sample_id, key, source, text
    images.parquet        (an image corpus, instead of texts.jsonl) image_id, key, path,
                          label, width, height, thumbnail (PNG of the model's input
                          before normalisation)
    extraction.json       the config, its hash, the summary, the modality (and an image
                          corpus's token layout and unreadable images); written last, so
                          its presence marks a finished extraction

A local output is built under a staging name and published whole (one rename). An
object store has no rename: each dataset is committed in place by its own manifest, and
``extraction.json`` is put last.

This module is the driver: it plans the model, then runs it over the corpus once; the
stage's tasks write the outputs' datasets as they go (``outputs.StageWrite``), committed
by the driver after the stage. The sample rows are stored only for an output that reads
them afterwards (the Zarr run, datasets partitioned by hook point). Then the tables and
``extraction.json``. The config is in ``config.py``, what the workers run in
``workers.py``, the output formats in ``outputs.py``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs

from ..dataset import DatasetLocation, mark_complete
from ..dataset.publish import publishing
from ..spark.compat import default_parallelism, to_arrow
from .config import ExtractConfig, ExtractionSummary, config_hash
from .corpus import (
    corpus_sha256,
    load_corpus,
    number_texts,
    numbered_demo,
)
from .images import IMAGE_COLUMNS, aligned_partitions, load_images, number_images
from .model import ExtractionError, Hook, MlpBlock, ModelSource, resolve_model, weights_hash
from .outputs import (
    ExtractionOutput,
    SampleRows,
    StageWrite,
    outputs_for,
    partition_multiple,
    token_dataset_name,
)
from .vision import TOKEN_KINDS, ImageTokens
from .workers import (
    MODEL_PLAN_SCHEMA,
    SCALAR_COLUMNS,
    TASK_COMMITS,
    TOKEN_COUNT_SCHEMA,
    count_fn,
    plan_fn,
    run_model_fn,
    samples_schema,
    scalar_columns,
    task_results,
)

EXTRACTION_DOC = "extraction.json"
"""Written last: its presence marks a finished extraction."""


@dataclass(frozen=True)
class _ModelPlan:
    """The model and its hook points, checked on the driver before any task starts."""

    source: ModelSource
    hooks: tuple[Hook, ...]
    widths: dict[str, int]
    """Hidden width by hook name."""
    weights_sha256: str
    max_length: int
    """Tokens per model input (``config.max_length``, or the model's context for 0)."""
    bos_added: bool
    """Whether the tokenizer puts a BOS token before every text."""
    image_tokens: ImageTokens | None = None
    """A vision model's token layout (an image corpus)."""
    mlp_blocks: tuple[MlpBlock, ...] = ()
    """The MLP blocks ``mlp_layers`` named, in layer order."""

    def hook_metadata(self) -> dict[str, dict[str, str]]:
        """What a hook point's dataset records beyond the extraction's metadata: an MLP's
        input or output says its layer (``mlp_layer``) and, where one module is the whole
        MLP, that module (``mlp_block``)."""
        extra: dict[str, dict[str, str]] = {}
        for block in self.mlp_blocks:
            tags = {"mlp_layer": str(block.layer)}
            if block.module:
                tags["mlp_block"] = block.module
            extra[block.input.name] = extra[block.output.name] = tags
        return extra


@dataclass(frozen=True)
class _Corpus:
    """The numbered corpus: texts (``key, text, source, sample_id``) or images
    (``image_id, key, path, label, content, width, height``)."""

    rows: object
    """The DataFrame the model stage reads."""
    stored: object
    """The persisted rows to unpersist afterwards, or None."""
    bad_images: pa.Table | None = None
    """The unreadable images skipped: key, path, error."""
    n_images: int = 0
    """The readable images (an image corpus)."""


@dataclass(frozen=True)
class _ModelRun:
    """The model's output: one row per model input, and what it adds up to."""

    samples: object
    """The stored sample rows (a DataFrame; the caller unpersists it), or None when no
    output reads them."""
    info: pa.Table
    """sample_id, window, key, seq_len, first_pos, text_chars, source of every row (and
    ``IMAGE_COLUMNS`` for an image)."""
    seconds: float

    @property
    def tokens(self) -> int:
        return int(pc.sum(self.info.column("seq_len")).as_py())


def worker_threads(parallelism: int, threads: int = 0) -> int:
    """torch threads of each extraction worker: ``threads``, or (0) the machine's cores
    over Spark's ``parallelism``, at least one."""
    return threads or max(1, (os.cpu_count() or 1) // parallelism)


def run_extraction(
    spark,
    config: ExtractConfig,
    out_dir: str | os.PathLike,
    *,
    corpus=None,
    images=None,
    overwrite: bool = False,
    storage_options: Mapping[str, str] | None = None,
    commit_groups: int = 1,
    on_tokens: Callable[[int], None] | None = None,
    threads: int = 0,
) -> ExtractionSummary:
    """Run the job; see the module docstring for the outputs. A reader never takes a
    partial output for a finished one: a local ``out_dir`` appears whole or not at all; on
    an object store ``extraction.json`` appears last (after deleting the previous
    extraction, with ``overwrite=True``), and a failed job deletes what it wrote.

    ``spark``: a classic or a Spark Connect session. ``out_dir``: a local path or a URI
    (``s3://bucket/acts``, ``gs://``, ``abfss://``, ...; see ``DatasetLocation.of``).
    ``corpus``: a DataFrame with the text column ``config.text_column`` (and optionally
    ``source``) instead of ``config.corpus``; the config hash then names its texts by
    content. ``images``: a DataFrame of images instead of ``config.images`` (Spark's
    ``image`` source, or a table with an image-bytes column ``config.image_column``, a
    ``path`` or ``config.id_column``, and optionally ``config.label_column``); the config
    hash then names its images by key. ``storage_options``: for a URI, e.g. ``{"endpoint_url": ...}`` (the
    writer's storage options; the usual ``AWS_*`` variables otherwise). ``threads``: torch
    threads per Python worker (0: the machine's cores over Spark's parallelism).

    ``commit_groups`` > 1 (texts into the safetensors datasets, no ``partition_by_hook``):
    the model stage runs on that many groups of texts (``sample_id`` modulo
    ``commit_groups``) in turn, each committed as one append of every dataset, row-aligned
    across the hook points, and each dataset is marked complete (``dataset.mark_complete``)
    after the last, so a reader can follow them as they grow (``torch.FollowingBatches``,
    ``SAEConfig.follow``). The output is written in place (locally too), ``extraction.json``
    last; a failed job deletes it. ``on_tokens``: with groups, told the token rows to come
    (from the tokenizer) before the first group, e.g. a trainer's budget."""
    target = DatasetLocation.of(out_dir, storage_options=storage_options)
    local = isinstance(target.fs, pafs.LocalFileSystem)
    outputs = outputs_for(config)
    _check_target(target, local, outputs, overwrite)
    config = _checked_config(config, corpus, images, outputs, commit_groups)
    cores = default_parallelism(spark)
    threads = worker_threads(cores, threads)
    source = resolve_model(config.model)
    # The Python workers load the model to plan (one per core: they keep it for the model
    # stage) while Spark numbers the texts: neither needs the other.
    pool = ThreadPoolExecutor(1, thread_name_prefix="number-texts")
    numbering = pool.submit(
        _numbered_corpus, spark, config, corpus if images is None else images,
        config.partitions or cores,
    )  # fmt: skip
    pool.shutdown(wait=False)
    try:
        plan = _plan_model(spark, config, outputs, source, workers=cores, threads=threads)
    except BaseException:  # a bad model or hook point: say so now, drop the texts when done
        numbering.add_done_callback(
            lambda f: f.exception() is None and _unpersist(f.result().stored)
        )
        raise
    numbered = numbering.result()
    try:
        _report_bad_images(numbered.bad_images, config)
        if config.modality == "image" and not numbered.n_images:
            raise ExtractionError(f"images {config.images!r}: no readable image")
        # max_length 0 (the model's context) is recorded and hashed as the number it means;
        # the workers keep the config as planned: their loaded model is keyed by it
        recorded = dataclasses.replace(config, max_length=plan.max_length)
        extraction = _Extraction(
            recorded, config, plan, numbered, _config_hash(recorded, plan, numbered.rows),
            dict(storage_options or {}) if not local else {}, outputs, threads,
            cores=config.partitions or cores, groups=max(1, commit_groups), on_tokens=on_tokens,
        )  # fmt: skip
        if local and commit_groups <= 1:
            with publishing(target.root) as staging:
                summary = extraction(DatasetLocation.of(staging))
            return dataclasses.replace(summary, out_dir=Path(target.root))
        return _write_in_place(target, extraction)
    finally:
        _unpersist(numbered.stored)


def _checked_config(config: ExtractConfig, corpus, images, outputs, commit_groups: int):
    """The config of a run given these inputs: a corpus or images DataFrame named as such
    (one source only); grouped commits only where nothing reads every sample at the end."""
    if commit_groups > 1 and (config.modality == "image" or any(o.reads_rows for o in outputs)):
        raise ExtractionError(
            "commit_groups takes a text corpus into the safetensors datasets alone (no "
            "Zarr run, saev dump or partition_by_hook: those read every sample at the end)"
        )
    if corpus is not None:
        if config.corpus != ExtractConfig.corpus:
            raise ExtractionError(
                f"corpus {config.corpus!r} in the config and a corpus DataFrame: give one"
            )
        config = dataclasses.replace(config, corpus="dataframe")
    if images is not None:
        if config.images or corpus is not None:
            raise ExtractionError(
                "images in the config (or a text corpus) and an images DataFrame: give one"
            )
        config = dataclasses.replace(config, images="dataframe")
    return config


def _report_bad_images(bad: pa.Table | None, config: ExtractConfig) -> None:
    """The unreadable images: an error naming the first (``bad_images="fail"``), else
    a warning (they are listed in ``extraction.json``)."""
    import warnings

    if bad is None or bad.num_rows == 0:
        return
    first = bad.sort_by("key").slice(0, 1).to_pylist()[0]
    if config.bad_images == "fail":
        raise ExtractionError(
            f"image {first['path']} cannot be read ({first['error']}); {bad.num_rows} "
            "unreadable image(s) in all (bad_images='skip' leaves them out)"
        )
    warnings.warn(
        f"{bad.num_rows} unreadable image(s) skipped (listed in extraction.json), e.g. "
        f"{first['path']}: {first['error']}",
        stacklevel=3,
    )


def _unpersist(stored) -> None:
    if stored is not None:
        stored.unpersist()


def _check_target(
    target: DatasetLocation, local: bool, outputs: list[ExtractionOutput], overwrite: bool
):
    exists = os.path.exists(target.root) if local else target.exists()
    if exists and not overwrite:
        raise ExtractionError(f"{target} already exists; pass overwrite=True to replace it")
    for output in outputs:
        refusal = output.target_refusal(str(target), local)
        if refusal:
            raise ExtractionError(refusal)


def _plan_model(
    spark,
    config: ExtractConfig,
    outputs: list[ExtractionOutput],
    source: ModelSource,
    *,
    workers: int,
    threads: int,
) -> _ModelPlan:
    """Load the model in ``workers`` Python workers (one job, a task each), which keep it
    for the model stage, and plan from what they report: a bad model or hook point, or
    hook points an output cannot take, fail before the model stage. The driver itself
    imports no torch."""
    tasks = spark.range(0, workers, 1, workers)
    reports = to_arrow(tasks.mapInArrow(plan_fn(source, config, threads), MODEL_PLAN_SCHEMA))
    doc = json.loads(reports.column("plan")[0].as_py())
    if "error" in doc:
        raise ExtractionError(doc["error"])
    hooks = tuple(Hook(module, where) for module, where in doc["hooks"])
    widths = {h.name: int(doc["widths"][h.name]) for h in hooks}
    for output in outputs:
        refusal = output.widths_refusal(widths)
        if refusal:
            raise ExtractionError(refusal)
    image = ImageTokens.from_dict(doc["image"]) if "image" in doc else None
    mlps = tuple(
        MlpBlock(layer, Hook(read, "input"), Hook(write, "output"))
        for layer, read, write in doc["mlp_blocks"]
    )
    return _ModelPlan(
        source, hooks, widths, weights_hash(source.path), doc["max_length"], doc["bos_added"],
        image, mlps,
    )  # fmt: skip


def _numbered_corpus(spark, config: ExtractConfig, corpus, partitions: int) -> _Corpus:
    """The corpus numbered by key: texts (``number_texts``; the demo corpus numbered on
    the driver, ``numbered_demo``) or images (``number_images``: checked first, the
    unreadable ones left out and reported)."""
    if config.modality == "image":
        return _Corpus(*number_images(load_images(spark, config, corpus), config, partitions))
    if corpus is None and config.corpus == "demo":
        return _Corpus(numbered_demo(spark, config, partitions), None)
    texts = load_corpus(spark, config, corpus)
    if config.max_texts:
        texts = texts.orderBy("key").limit(config.max_texts)
    # sample_id: the text's rank by key, so ids do not depend on partitioning; stored
    # once: the model stage and texts.jsonl both read the texts
    return _Corpus(*number_texts(texts, partitions))


def _run_model(
    texts, plan: _ModelPlan, config: ExtractConfig, writes: list[StageWrite], *, store: bool,
    threads: int,
) -> _ModelRun:  # fmt: skip
    """Run the model over every text (Spark's progress bar shows it), ``threads`` torch
    threads per worker, the tasks writing ``writes`` as they go; each write is committed
    once every task has run (aborted by the caller otherwise). With ``store`` the sample
    rows are persisted on disk, for the outputs that read them."""
    from pyspark import StorageLevel

    started = time.perf_counter()
    samples = texts.mapInArrow(
        run_model_fn(plan.source, config, threads, writes, tensors=store),
        samples_schema(plan.hooks, tensors=store, images=config.modality == "image"),
    )
    if store:
        samples = samples.persist(StorageLevel.DISK_ONLY)
    try:
        # one pass: collecting the scalar columns stores every column (the first read of
        # a persisted frame computes all of it); a second read would load it all from disk
        info = to_arrow(samples.select(*scalar_columns(config), TASK_COMMITS))
        if info.num_rows == 0:
            raise ExtractionError(f"corpus {config.corpus!r} has no non-empty text")
        commits = info.column(TASK_COMMITS)
        for write, results in zip(writes, task_results(commits, len(writes)), strict=True):
            write.job.commit(results)
        return _ModelRun(
            samples if store else None, info.drop_columns([TASK_COMMITS]),
            time.perf_counter() - started,
        )  # fmt: skip
    except BaseException:
        if store:
            samples.unpersist()
        raise


def _config_hash(config: ExtractConfig, plan: _ModelPlan, texts) -> str:
    if "dataframe" in (config.corpus, config.images):  # name the texts by content
        keys = to_arrow(texts.select("key")).column("key").to_pylist()
        return config_hash(config, plan.weights_sha256, corpus_sha256(keys))
    return config_hash(config, plan.weights_sha256)


@dataclass
class _Extraction:
    """The model stage and every output of one extraction, into a location,
    ``extraction.json`` last."""

    config: ExtractConfig
    """The config as recorded (``max_length`` the number it means)."""
    planned: ExtractConfig
    """The config the workers planned with (their loaded model is keyed by it)."""
    plan: _ModelPlan
    corpus: _Corpus
    config_hash: str
    storage_options: dict[str, str]
    """Passed to the Spark writer as data-source options (empty for a local output)."""
    outputs: list[ExtractionOutput]
    threads: int
    cores: int
    """Partitions of the corpus."""
    groups: int = 1
    """Groups of texts the model stage runs on in turn, each committed as an append."""
    on_tokens: Callable[[int], None] | None = None
    """With groups: told the token rows to come before the first group runs."""

    def __call__(self, out: DatasetLocation) -> ExtractionSummary:
        rows = SampleRows(
            None, self.plan.hooks, dict(self.plan.widths), self.config.dtype,
            self.config.max_length, self.config.rows_per_shard, self._base_metadata(),
            self.storage_options, self.plan.image_tokens, self.plan.hook_metadata(),
        )  # fmt: skip
        texts = self.corpus.rows
        if self.plan.image_tokens is not None:  # partitions on the outputs' multiples
            multiple = partition_multiple(self.outputs, rows)
            texts = aligned_partitions(texts, multiple, self.cores, self.corpus.n_images)
        if self.groups > 1:
            run, finished = self._grouped(out, rows, texts)
        else:
            run, _ = self._model_stage(out, rows, texts)
            finished = []
        try:
            rows = dataclasses.replace(rows, samples=run.samples)
            for output in self.outputs:  # each one whole before the extraction is finished
                output.write(out, rows)
            for location in finished:  # followers stop once every row is read
                mark_complete(location)
            self._tables(out, run)
            summary = self._summary(out, run)
            out.put_json(EXTRACTION_DOC, self._extraction_doc(summary))  # last: marks it
            return summary
        finally:
            if run.samples is not None:
                run.samples.unpersist()

    def _model_stage(self, out: DatasetLocation, rows: SampleRows, texts):
        """The model over ``texts``, the stage writes committed after it (aborted if it
        fails); returns the run and its stage writes."""
        writes = []
        try:
            for output in self.outputs:
                writes += output.stage_writes(out, rows)
            run = _run_model(
                texts, self.plan, self.planned, writes, threads=self.threads,
                store=any(o.reads_rows for o in self.outputs),
            )  # fmt: skip
            return run, writes
        except BaseException:
            for write in writes:  # what a committed write published stays: it is listed
                write.job.abort()
            raise

    def _grouped(self, out: DatasetLocation, rows: SampleRows, texts) -> tuple[_ModelRun, list]:
        """The model stage on each group of texts in turn (``commit_groups``), each an
        append of every dataset; returns the whole run and the datasets to mark complete."""
        from pyspark.sql import functions as F

        if self.on_tokens is not None:
            count = count_fn(self.plan.source, self.planned, self.threads)
            tokens = to_arrow(texts.mapInArrow(count, TOKEN_COUNT_SCHEMA)).column("tokens")
            self.on_tokens(int(pc.sum(tokens).as_py() or 0))
        runs, datasets = [], {}
        for g in range(self.groups):
            group = texts.where(F.col("sample_id") % self.groups == g)
            run, written = self._model_stage(out, dataclasses.replace(rows, append=g > 0), group)
            runs.append(run)
            # the safetensors datasets' writes alone (grouped commits refuse other outputs)
            datasets.update((w.job.location.uri, w.job.location) for w in written)
        info = pa.concat_tables([r.info for r in runs])
        return _ModelRun(None, info, sum(r.seconds for r in runs)), list(datasets.values())

    def _base_metadata(self) -> dict[str, str]:
        """What every dataset's manifest metadata says about the extraction."""
        config = self.config
        if self.plan.image_tokens is not None:
            return {
                "model": self.plan.source.name,
                "model_weights_sha256": self.plan.weights_sha256,
                "dtype": config.dtype,
                "config_hash": self.config_hash,
                "corpus": config.images,
                "modality": "image",
                "image_tokens": json.dumps(self.plan.image_tokens.to_dict(), sort_keys=True),
            }
        tokenizer_settings = {"max_length": config.max_length, "long_texts": config.long_texts,
                              "padding": "excluded"}  # fmt: skip
        if self.plan.bos_added:  # said only where there is a BOS to keep or drop
            tokenizer_settings["bos"] = "kept" if config.keep_bos else "dropped"
        return {
            "model": self.plan.source.name,
            "model_weights_sha256": self.plan.weights_sha256,
            "dtype": config.dtype,
            "tokenizer": json.dumps(tokenizer_settings, sort_keys=True),
            "config_hash": self.config_hash,
            "corpus": config.corpus,
        }

    def _tables(self, out: DatasetLocation, run: _ModelRun) -> None:
        """samples.parquet and texts.jsonl, each written to a local file first (locally the
        output's own; elsewhere a spool file uploaded in one stream: the texts may not fit
        in memory)."""
        import pyarrow.parquet as pq

        info = run.info.sort_by("sample_id")
        samples = info.select(list(SCALAR_COLUMNS))
        out.write_shard("samples.parquet", lambda path: pq.write_table(samples, path))
        if self.plan.image_tokens is not None:
            images = pa.table({
                "image_id": info.column("sample_id"), "key": info.column("key"),
                "path": info.column("source"),
                **{name: info.column(name) for name in IMAGE_COLUMNS},
            })  # fmt: skip
            out.write_shard("images.parquet", lambda path: pq.write_table(images, path))
        else:
            out.write_shard("texts.jsonl", self._write_texts)

    def _write_texts(self, path: str) -> None:
        rows = self.corpus.rows.select("sample_id", "key", "source", "text").orderBy("sample_id")
        with open(path, "w") as f:
            for row in rows.toLocalIterator():
                f.write(json.dumps(row.asDict(), ensure_ascii=False) + "\n")

    def _summary(self, out: DatasetLocation, run: _ModelRun) -> ExtractionSummary:
        files = out.list(recursive=True).values()
        return ExtractionSummary(
            Path(out.root) if out.local_file(EXTRACTION_DOC) else out.uri,
            texts=len(run.info.column("sample_id").unique()),
            samples=run.info.num_rows,
            tokens=run.tokens,
            bytes=sum(i.size for i in files if i.type == pafs.FileType.File),
            seconds=run.seconds,
            config_hash=self.config_hash,
            hooks=dict(self.plan.widths),
            modality=self.config.modality,
            bad_images=self._bad_images().column("path").to_pylist(),
        )

    def _bad_images(self) -> pa.Table:
        bad = self.corpus.bad_images
        if bad is None:
            return pa.table(
                {"key": [], "path": [], "error": []},
                schema=pa.schema(
                    [("key", pa.string()), ("path", pa.string()), ("error", pa.string())]
                ),
            )
        return bad.sort_by("key")

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
                    "dataset": token_dataset_name(h, self.config.partition_by_hook),
                    "kv_column": h.column,
                    "width": widths[h.name],
                }
                for h in self.plan.hooks
            },
            **({"mlp_blocks": self._mlp_doc()} if self.plan.mlp_blocks else {}),
            "modality": self.config.modality,
            **(self._image_doc() if self.plan.image_tokens is not None else {}),
            "summary": {
                "texts": summary.texts,
                "samples": summary.samples,
                "tokens": summary.tokens,
                "bytes": summary.bytes,
                "seconds": summary.seconds,
                "tokens_per_s": summary.tokens_per_s,
            },
        }

    def _mlp_doc(self) -> list[dict]:
        """The MLP blocks ``mlp_layers`` named, in layer order: each one's layer, module
        (null where the MLP is spread over modules), hook points and datasets."""
        dataset = {h.name: token_dataset_name(h, self.config.partition_by_hook)
                   for h in self.plan.hooks}  # fmt: skip
        return [
            {
                "layer": b.layer, "block": b.module or None,
                "input": b.input.name, "output": b.output.name,
                "input_dataset": dataset[b.input.name], "output_dataset": dataset[b.output.name],
            }
            for b in self.plan.mlp_blocks
        ]  # fmt: skip

    def _image_doc(self) -> dict:
        """What an image extraction adds to ``extraction.json``: the token layout and the
        unreadable images skipped."""
        layout = self.plan.image_tokens
        return {
            "patch_grid": list(layout.grid),
            "patch_size": layout.patch_size,
            "image_size": list(layout.image_size),
            "n_registers": layout.n_registers,
            "n_cls": layout.n_cls,
            "tokens_per_image": layout.n_tokens,
            "token_kinds": list(TOKEN_KINDS),
            "bad_images": self._bad_images().select(["path", "error"]).to_pylist(),
        }


def _write_in_place(target: DatasetLocation, write: _Extraction) -> ExtractionSummary:
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
