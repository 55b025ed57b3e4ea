"""Attribution graphs of many prompts in Spark.

The prompts (a text file, one per line; a parquet table's column; or a DataFrame's
column) are numbered ``prompt_id`` 0.. in their order and handed to ``mapInArrow``;
each Python worker loads the model and the transcoders once (kept between tasks) and
makes each prompt's graph (``attribution.attribute``), pruned (``graph.prune``) and
scored. A prompt that cannot be attributed (empty, longer than the model's context) is
a row with ``status = "error"`` and the reason; the job goes on. Written into
``output``:

- ``graphs.parquet``: one row per prompt: ``prompt_id``, ``prompt``, ``status``,
  ``error``, ``n_tokens``, ``n_active`` (the prompt's active features), ``n_features``
  (those attributed: all, or ``max_feature_nodes``), ``n_nodes``, ``replacement_score``,
  ``completeness_score``, ``n_kept_nodes``, ``n_kept_edges`` (one parquet file);
- ``nodes/prompt_id=N/``: every node of a graph: ``node`` (its index in the adjacency),
  ``node_id``, ``kind``, ``layer``, ``pos``, ``latent``, ``token``, ``activation``,
  ``value``, ``influence`` (cumulative share), ``kept``, ``probability`` (a logit
  node's; null for the others);
- ``edges/prompt_id=N/``: the pruned graph's edges ``source``, ``target``, ``weight``
  (nodes, edges and the browser's data written by the tasks as they make each graph);
- ``adjacency/``: a safetensors KV dataset (our manifest and tensor index), key
  ``p{prompt_id}``, tensor ``adjacency`` ``[N, N]`` float32 (the unpruned graph);
- ``index.html``, ``graph.html``, ``data/``: the graph browser (``page.py``);
- ``graphs.json`` last: the config, the counts, each refused prompt (``prompt_id``,
  ``prompt``, ``error``) and the scores' mean and min over the graphs.

Storage. ``output`` is a local path, a ``file:`` URI or any URI ``DatasetLocation``
takes (``s3://bucket/graphs``, ``gs://``, ``abfs://``, ``hdfs://``, fsspec protocols),
with ``storage_options`` or the usual ``AWS_*`` variables; every file goes through the
storage layer (``dataset.publish.StagedOutput``), none through Spark's Hadoop writers.
Everything is built under a hidden sibling, ``.{name}.staging-*``. Each task attempt
writes its graphs' files under a folder of its own there (``_attempts/{attempt}/``) and
names them in its rows; the driver collects the rows once, writes the adjacency dataset
(the ``safetensors`` data source, its own commit), the prompt table (pyarrow), the
browser's pages and ``graphs.json`` into the staging location, then publishes the files
of the attempts whose rows it collected and deletes the rest: a failed, killed or
speculative attempt leaves nothing in the output, and no graph is ever half written
there. A local output is then renamed into place (``dataset.publish.publish``: the old
output or the new one, never a mix), and must be on a disk every executor shares (a
local master, a network mount; the driver checks every reported file is there). On an
object store nothing of the old output is touched until the new one is wholly staged;
then its ``graphs.json`` is deleted, the new files copied in (server-side), the old
output's other files deleted and ``graphs.json`` copied last: a failed job leaves the old
output as it was; a failure while publishing leaves it without ``graphs.json``
(unfinished: run again); a reader listing it while it is published may see both
generations' files, so read an output that has its ``graphs.json``.

``model`` and ``transcoders`` may be URIs too: each worker copies them into its
executor's files directory once per version (``dataset.fetch.local_copy``), so a cluster
without a shared disk runs the job; a local path must exist on every executor. A
``prompts`` file or table given as a URI is read by the driver.

    run_graphs(spark, GraphsConfig(model="toy", transcoders=("clt.safetensors",),
                                   prompts="prompts.txt", output="out/graphs"))
    spark.read.parquet("out/graphs/nodes").where("kind = 'feature' AND kept")
    run_graphs(spark, GraphsConfig(model="s3://bucket/models/toy",
                                   transcoders=("s3://bucket/clt.safetensors",),
                                   prompts="s3://bucket/prompts.txt",
                                   output="s3://bucket/graphs"),
               storage_options={"endpoint_url": "http://127.0.0.1:9000"})
"""

from __future__ import annotations

import dataclasses
import errno
import os
import re
import tempfile
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from ..format.errors import InvalidArgumentError

NODE = pa.struct([("node", pa.int32()), ("node_id", pa.string()), ("kind", pa.string()),
                  ("layer", pa.int32()), ("pos", pa.int32()), ("latent", pa.int32()),
                  ("token", pa.int64()), ("activation", pa.float32()), ("value", pa.float32()),
                  ("influence", pa.float32()), ("kept", pa.bool_()),
                  ("probability", pa.float32())])  # fmt: skip
EDGE = pa.struct([("source", pa.int32()), ("target", pa.int32()), ("weight", pa.float32())])
SCALARS = [("prompt_id", pa.int64()), ("prompt", pa.string()), ("status", pa.string()),
           ("error", pa.string()), ("n_tokens", pa.int32()), ("n_active", pa.int32()),
           ("n_features", pa.int32()),
           ("n_nodes", pa.int32()), ("replacement_score", pa.float64()),
           ("completeness_score", pa.float64()), ("n_kept_nodes", pa.int32()),
           ("n_kept_edges", pa.int32())]  # fmt: skip
SCHEMA = pa.schema([*SCALARS, ("nodes", pa.list_(NODE)), ("edges", pa.list_(EDGE)),
                    ("adjacency", pa.binary())])  # fmt: skip
"""``graph_row``'s fields; the tasks hand Spark ``SCALARS``, the names of the files they
wrote and the adjacency only (``TASK_SCHEMA``), having written the rest themselves."""
TASK_SCHEMA = pa.schema([*SCALARS, ("files", pa.list_(pa.string())), ("adjacency", pa.binary())])
SCALARS_SCHEMA = pa.schema(SCALARS)
PROMPTS_TABLE = "graphs.parquet"
"""The table of ``SCALARS``, one row per prompt."""
ADJACENCY_SHARD_MB = 64
"""The adjacency dataset's shards: a task's writer holds one in memory (the default 300 MB
shard, its buffer doubling, ran a 1 GB local driver out of heap at 10,000 prompts)."""
SUMMARY = "graphs.json"
"""The summary, published last: its presence marks a finished output."""


@dataclass(frozen=True)
class GraphsConfig:
    """An attribution-graph job."""

    model: str
    """A Hugging Face causal LM directory (Llama family): a local path every executor
    reaches, or a URI (``s3://...``) each executor copies once."""
    transcoders: tuple[str, ...]
    """One CLT file, or one transcoder file per MLP block (in block order); paths or URIs
    as ``model``."""
    output: str
    """The directory the graphs are published into (replaced whole): a local path or a
    URI (``s3://bucket/graphs``; module docstring, "Storage")."""
    prompts: str = ""
    """A text file (one prompt per line) or a parquet table, a path or a URI; empty when a
    DataFrame is given."""
    column: str = "prompt"
    """The prompts' column of a parquet table or DataFrame."""
    max_logits: int = 10
    """At most this many logit nodes per graph."""
    logit_probability: float = 0.95
    """Logit nodes are taken, most probable first, until their probability sums to this."""
    node_threshold: float = 0.8
    """Pruning keeps the most influential nodes making up this share of the influence."""
    edge_threshold: float = 0.98
    """Pruning keeps the highest-scoring edges making up this share of the edge scores."""
    batch_size: int = 64
    """Targets per backward pass."""
    max_feature_nodes: int = 0
    """Attribute at most this many features per prompt, the most influential first
    (partial attribution, as circuit-tracer's); 0: every active feature."""
    update_interval: int = 4
    """Batches attributed between two re-rankings of the features by influence."""
    first_position: bool = False
    """Position 0's features and errors are nodes (off: circuit-tracer's convention)."""
    rule: str = "topk"
    """The transcoders' inference rule: "topk" or "threshold"."""
    k: int = 0
    """Top-k's k for a dictionary that records none (a circuit-tracer file); 0: its own."""
    partitions: int = 0
    """Tasks (0: Spark's default parallelism)."""
    browser: bool = True
    """Write the graph browser (``index.html``, ``graph.html``; ``page.py``)."""
    threads: int = 0
    """Torch threads per Python worker; 0 = torch's default (every core: set it to cores /
    tasks when several tasks share a machine)."""
    feature_pages: str = ""
    """The browser's link from a feature node to that latent's page in a feature browser:
    a URL, or a path relative to ``output``, in which ``{layer}`` and ``{latent}`` stand
    for the node's (e.g. ``"../features/layer{layer}/index.html#{latent}"``); empty = no
    link."""

    def __post_init__(self):
        if not self.transcoders:
            raise InvalidArgumentError("transcoders: give a CLT file or per-layer transcoder files")


_LOADED: dict = {}


def _cache_dir() -> str:
    """Where a worker keeps its copies of remote models and dictionaries: in a Spark task
    the executor's files directory (``SparkFiles``: shared by its Python workers, and
    removed with the application's files: when a local session stops, by the cluster
    manager's rules elsewhere), else a folder of the temporary directory."""
    from pyspark import SparkFiles, TaskContext

    if TaskContext.get() is not None:
        return os.path.join(SparkFiles.getRootDirectory(), "pyspark-safetensors-remote")
    return os.path.join(tempfile.gettempdir(), f"pyspark-safetensors-remote-{os.getuid()}")


def _loaded(config: GraphsConfig, storage_options: Mapping[str, str] | None = None):
    """The replacement model (its tokenizer set), once per Python worker. A model or
    dictionary given as a URI is copied into the worker's cache first (``local_copy``:
    once per version of it)."""
    from ..circuits.replacement import ReplacementModel
    from ..dataset.fetch import local_copy

    if config.threads:
        import torch

        torch.set_num_threads(config.threads)

    def local(path: str) -> str:
        return local_copy(path, cache_dir=_cache_dir(), storage_options=storage_options)

    model, transcoders = local(config.model), tuple(local(t) for t in config.transcoders)
    key = (model, transcoders, config.rule, config.k)
    if key not in _LOADED:
        _LOADED.clear()
        paths = transcoders[0] if len(transcoders) == 1 else list(transcoders)
        _LOADED[key] = ReplacementModel.load(model, paths, rule=config.rule, k=config.k or None)
    return _LOADED[key]


def graph_row(config: GraphsConfig, prompt_id: int, prompt: str | None,
              replacement_model=None) -> dict:  # fmt: skip
    """One prompt's row of ``SCHEMA`` (an error row when it cannot be attributed), through
    ``replacement_model`` (default: the config's, loaded once per process)."""
    from ..circuits.replacement import ReplacementError
    from .attribution import AttributionConfig, AttributionError, attribute
    from .graph import prune, scores

    row = dict.fromkeys(SCHEMA.names) | {"prompt_id": prompt_id, "prompt": prompt}
    if replacement_model is None:
        replacement_model = _loaded(config)
    try:
        if not prompt or not prompt.strip():
            raise AttributionError("an empty prompt")
        ids = replacement_model.tokenizer(prompt)["input_ids"]
        attr = AttributionConfig(config.max_logits, config.logit_probability, config.batch_size,
                                 config.max_feature_nodes, config.update_interval,
                                 config.first_position)  # fmt: skip
        graph = attribute(replacement_model, ids, attr, prompt)
    except ReplacementError as e:  # the prompt's (an AttributionError) or its model's
        return row | {"status": "error", "error": str(e), "nodes": [], "edges": []}
    pruned = prune(graph, config.node_threshold, config.edge_threshold)
    replacement, completeness = scores(graph)
    return row | {
        "status": "ok", "error": None, "n_tokens": graph.n_pos, "n_active": graph.n_active,
        "n_features": graph.n_features,
        "n_nodes": graph.n_nodes, "replacement_score": replacement,
        "completeness_score": completeness, "n_kept_nodes": int(pruned.node_mask.sum()),
        "n_kept_edges": int(pruned.edge_mask.sum()), "nodes": _nodes(graph, pruned),
        "edges": _edges(graph, pruned), "adjacency": graph.adjacency.astype("<f4").tobytes(),
    }  # fmt: skip


def _nodes(graph, pruned) -> list[dict]:
    F, E, P = graph.n_features, graph.n_blocks * graph.n_pos, graph.n_pos
    K = len(graph.logit_tokens)
    none_f, none_e, none_p, none_k = [None] * F, [None] * E, [None] * P, [None] * K
    errors = [divmod(i, P) for i in range(E)]
    columns = {  # by kind: features, errors, embeddings, logits (python lists: fast dicts)
        "layer": graph.feature_layer.tolist() + [b for b, _ in errors] + none_p + none_k,
        "pos": graph.feature_pos.tolist() + [p for _, p in errors] + list(range(P)) + none_k,
        "latent": graph.feature_latent.tolist() + none_e + none_p + none_k,
        "token": none_f + none_e + graph.tokens.tolist() + graph.logit_tokens.tolist(),
        "activation": graph.activations.tolist() + none_e + none_p + none_k,
        "kind": graph.kinds().tolist(), "node_id": graph.node_ids(),
        "value": graph.values.tolist(), "influence": pruned.cumulative.tolist(),
        "kept": pruned.node_mask.tolist(),
        "probability": none_f + none_e + none_p + graph.logit_probabilities.tolist(),
    }  # fmt: skip
    names = list(columns)
    return [
        {"node": i, **dict(zip(names, values, strict=True))}
        for i, values in enumerate(zip(*columns.values(), strict=True))
    ]


def _edges(graph, pruned) -> list[dict]:
    import numpy as np

    target, source = np.nonzero(pruned.edge_mask)
    weight = graph.adjacency[target, source]
    return [{"source": s, "target": t, "weight": w}
            for s, t, w in zip(source.tolist(), target.tolist(), weight.tolist(), strict=True)]  # fmt: skip


def write_graph_files(where, row: dict, token_text=None) -> list[str]:
    """Writes an attributed prompt's files under ``where`` (a ``DatasetLocation``, a path
    or a URI): its nodes and pruned edges as ``nodes/prompt_id=N/part-0.parquet`` and
    ``edges/prompt_id=N/part-0.parquet``, and with ``token_text`` (a token id's text) the
    browser's ``data/graph-N.js``; each file whole (one write, one PUT on an object
    store). Returns their names relative to ``where``. The job gives each task attempt a
    folder of its own and publishes only the files of the attempts it collected."""
    from ..dataset import DatasetLocation
    from .page import graph_data

    where = DatasetLocation.of(where)
    names = []
    for name, struct in (("nodes", NODE), ("edges", EDGE)):
        if row[name]:
            schema = pa.schema([struct.field(i) for i in range(struct.num_fields)])
            names.append(f"{name}/prompt_id={row['prompt_id']}/part-0.parquet")
            where.write_bytes(names[-1], parquet_bytes(pa.Table.from_pylist(row[name], schema)))
    if token_text is not None:
        names.append(f"data/graph-{row['prompt_id']}.js")
        where.write_bytes(names[-1], graph_data(row, token_text).encode())
    return names


def parquet_bytes(table: pa.Table) -> bytes:
    import pyarrow.parquet as pq

    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue().to_pybytes()


def _attempt_tag() -> str:
    """A name of this task attempt's own (the uuid covers a call outside Spark)."""
    from pyspark import TaskContext

    context, unique = TaskContext.get(), uuid.uuid4().hex[:8]
    if context is None:
        return f"driver-{unique}"
    attempt = f"{context.attemptNumber()}-{context.taskAttemptId()}"
    return f"{context.partitionId():05d}-{attempt}-{unique}"


def _graphs_fn(config: GraphsConfig, staging, storage_options: Mapping[str, str]):
    """The tasks' function: each prompt's graph, its files written under this attempt's
    folder of ``staging`` (a ``DatasetLocation``) and named in its row (``files``)."""

    def run(batches):
        import gc

        from ..dataset.publish import attempt_folder

        replacement_model = _loaded(config, storage_options)
        tokenizer = replacement_model.tokenizer
        # the worker's torch, transformers and model objects live as long as it does: out
        # of the collector's scans, which every graph's allocations trigger (~15% of a
        # small graph's time)
        gc.freeze()
        token_text = (lambda t: tokenizer.decode([t])) if config.browser else None
        folder = attempt_folder(_attempt_tag())
        mine = staging.child(folder)
        for batch in batches:
            ids, texts = batch.column("prompt_id").to_pylist(), batch.column("prompt").to_pylist()
            for prompt_id, text in zip(ids, texts, strict=True):
                row = graph_row(config, prompt_id, text, replacement_model)
                files = []
                if row["status"] == "ok":
                    files = [f"{folder}/{n}" for n in write_graph_files(mine, row, token_text)]
                yield pa.RecordBatch.from_pylist([row | {"files": files}], TASK_SCHEMA)

    return run


def numbered_prompts(spark, config: GraphsConfig, prompts=None,
                     storage_options: Mapping[str, str] | None = None):  # fmt: skip
    """``(prompt_id, prompt)`` in the prompts' order. A prompts file or table given as a
    URI (``s3://...``) is read by the driver through ``DatasetLocation`` (Spark's own
    readers would need the cluster's Hadoop connector for it)."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    if prompts is None:
        prompts = _read_prompts(spark, config, storage_options)
    if config.column not in prompts.columns:
        raise InvalidArgumentError(
            f"the prompts have no column {config.column!r}: {prompts.columns}"
        )
    order = Window.orderBy(F.monotonically_increasing_id())
    return prompts.select(
        (F.row_number().over(order) - 1).cast("long").alias("prompt_id"),
        F.col(config.column).cast("string").alias("prompt"),
    )


def _read_prompts(spark, config: GraphsConfig, storage_options: Mapping[str, str] | None):
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    from ..dataset import DatasetLocation
    from ..spark.compat import from_arrow

    if not config.prompts:
        raise InvalidArgumentError("prompts: give a text file, a parquet table or a DataFrame")
    source = DatasetLocation.of(config.prompts, storage_options=storage_options)
    if source.is_local:
        if config.prompts.endswith(".parquet") or Path(source.root).is_dir():
            return spark.read.parquet(source.root)
        return spark.read.text(source.root).withColumnRenamed("value", config.column)
    kind = source.fs.get_file_info(source.root).type
    if kind == pafs.FileType.NotFound:
        raise FileNotFoundError(errno.ENOENT, "no such file or directory", config.prompts)
    if config.prompts.endswith(".parquet") or kind != pafs.FileType.File:
        table = pq.read_table(source.root, filesystem=source.fs)
    else:
        folder, name = source.parent()
        lines = re.split(r"\r\n|\r|\n", folder.read_bytes(name).decode())
        if lines and not lines[-1]:  # a last line ending in a newline, as Spark reads it
            lines.pop()
        table = pa.table({config.column: pa.array(lines, pa.string())})
    return from_arrow(spark, table)


def _summary(scalars: list[dict], config: GraphsConfig) -> dict:
    """The config, the counts, the refused prompts and the scores' mean and min."""
    ok = [r for r in scalars if r["status"] == "ok"]
    errors = [{k: r[k] for k in ("prompt_id", "prompt", "error")}
              for r in scalars if r["status"] == "error"]  # fmt: skip
    scores = {}
    for name in ("replacement", "completeness"):
        values = [r[f"{name}_score"] for r in ok]
        scores[name] = {"mean": sum(values) / len(values) if values else None,
                        "min": min(values, default=None)}  # fmt: skip
    return {"config": dataclasses.asdict(config), "graphs": len(ok),
            "failed": len(errors), "errors": errors, "scores": scores}  # fmt: skip


def run_graphs(spark, config: GraphsConfig, prompts=None, *,
               storage_options: Mapping[str, str] | None = None) -> dict:  # fmt: skip
    """Every prompt's graph, written as the module docstring says; returns the summary.
    ``storage_options`` (``endpoint_url``, ``region``, ``path_style``, ``anonymous``; see
    ``DatasetLocation.of``) configure the storage of the output and of any model,
    dictionary or prompts file given as a URI; by default the ``AWS_*`` variables of each
    process (the driver's and the executors')."""
    from pyspark.sql import functions as F
    from pyspark.sql.pandas.types import from_arrow_schema

    from ..dataset import DatasetLocation
    from ..dataset.publish import staged_output
    from ..spark.compat import default_parallelism
    from ..spark.register import register
    from .page import index_files

    options = dict(storage_options or {})
    target = DatasetLocation.of(config.output, storage_options=options)
    register(spark)
    numbered = numbered_prompts(spark, config, prompts, options)
    n = config.partitions or default_parallelism(spark)
    names = [name for name, _ in SCALARS]
    with staged_output(target, SUMMARY) as out:
        staging = out.staging
        # the tasks write each graph's nodes, edges and page data as they make it (a
        # Spark write partitioned by prompt cost more than the graphs: a file per prompt
        # committed, and every node through the JVM), each attempt in a folder of its own
        graphs = (
            numbered.repartition(n, "prompt_id")
            .mapInArrow(_graphs_fn(config, staging, options), from_arrow_schema(TASK_SCHEMA))
            .persist()
        )
        try:
            # one collect: these rows name the attempts whose files are published
            rows = sorted((r.asDict() for r in graphs.select(*names, "files").collect()),
                          key=lambda r: r["prompt_id"])  # fmt: skip
            tensor = F.struct(F.col("adjacency").alias("data"),
                              F.array(F.col("n_nodes"), F.col("n_nodes")).alias("shape"),
                              F.lit("F32").alias("dtype"))  # fmt: skip
            (graphs.where("status = 'ok'")
             .select(F.format_string("p%d", "prompt_id").alias("key"), tensor.alias("adjacency"))
             .write.format("safetensors").options(**options).option("name_col", "key")
             .option("target_shard_size_mb", ADJACENCY_SHARD_MB)
             .mode("overwrite").save(staging.display("adjacency")))  # fmt: skip
        finally:
            graphs.unpersist()
        for row in rows:
            for staged in row.pop("files") or ():
                out.adopt(staged, staged.split("/", 2)[2])  # _attempts/{tag}/{name}
        staging.put_bytes(PROMPTS_TABLE, parquet_bytes(pa.Table.from_pylist(rows, SCALARS_SCHEMA)))
        if config.browser:
            for name, text in index_files(rows, config.feature_pages).items():
                staging.put_bytes(name, text.encode())
        summary = _summary(rows, config)
        staging.put_json(SUMMARY, summary)
    return summary
