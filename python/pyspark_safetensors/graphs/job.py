"""Attribution graphs of many prompts in Spark.

The prompts (a text file, one per line; a parquet table's column; or a DataFrame's
column) are numbered ``prompt_id`` 0.. in their order and handed to ``mapInArrow``;
each Python worker loads the model and the transcoders once (kept between tasks) and
makes each prompt's graph (``attribution.attribute``), pruned (``graph.prune``) and
scored. A prompt that cannot be attributed (empty, longer than the model's context) is
a row with ``status = "error"`` and the reason; the job goes on. Written, staged and
published whole into ``output``:

- ``graphs.parquet``: one row per prompt: ``prompt_id``, ``prompt``, ``status``,
  ``error``, ``n_tokens``, ``n_features``, ``n_nodes``, ``replacement_score``,
  ``completeness_score``, ``n_kept_nodes``, ``n_kept_edges``;
- ``nodes/prompt_id=N/``: every node of a graph: ``node`` (its index in the adjacency),
  ``node_id``, ``kind``, ``layer``, ``pos``, ``latent``, ``token``, ``activation``,
  ``value``, ``influence`` (cumulative share), ``kept``;
- ``edges/prompt_id=N/``: the pruned graph's edges ``source``, ``target``, ``weight``
  (nodes, edges and the browser's data written by the tasks as they make each graph);
- ``adjacency/``: a safetensors KV dataset (our manifest and tensor index), key
  ``p{prompt_id}``, tensor ``adjacency`` ``[N, N]`` float32 (the unpruned graph);
- ``index.html``, ``graph.html``, ``data/``: the graph browser (``page.py``);
- ``graphs.json`` last: the config, the counts, each refused prompt (``prompt_id``,
  ``prompt``, ``error``) and the scores' mean and min over the graphs.

    run_graphs(spark, GraphsConfig(model="toy", transcoders=("clt.safetensors",),
                                   prompts="prompts.txt", output="out/graphs"))
    spark.read.parquet("out/graphs/nodes").where("kind = 'feature' AND kept")
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from ..format.errors import InvalidArgumentError

NODE = pa.struct([("node", pa.int32()), ("node_id", pa.string()), ("kind", pa.string()),
                  ("layer", pa.int32()), ("pos", pa.int32()), ("latent", pa.int32()),
                  ("token", pa.int64()), ("activation", pa.float32()), ("value", pa.float32()),
                  ("influence", pa.float32()), ("kept", pa.bool_())])  # fmt: skip
EDGE = pa.struct([("source", pa.int32()), ("target", pa.int32()), ("weight", pa.float32())])
SCALARS = [("prompt_id", pa.int64()), ("prompt", pa.string()), ("status", pa.string()),
           ("error", pa.string()), ("n_tokens", pa.int32()), ("n_features", pa.int32()),
           ("n_nodes", pa.int32()), ("replacement_score", pa.float64()),
           ("completeness_score", pa.float64()), ("n_kept_nodes", pa.int32()),
           ("n_kept_edges", pa.int32())]  # fmt: skip
SCHEMA = pa.schema([*SCALARS, ("nodes", pa.list_(NODE)), ("edges", pa.list_(EDGE)),
                    ("adjacency", pa.binary())])  # fmt: skip
"""``graph_row``'s fields; the tasks hand Spark ``SCALARS`` and the adjacency only
(``TASK_SCHEMA``), having written the rest themselves."""
TASK_SCHEMA = pa.schema([*SCALARS, ("adjacency", pa.binary())])


@dataclass(frozen=True)
class GraphsConfig:
    """An attribution-graph job."""

    model: str
    """A local Hugging Face causal LM directory (Llama family)."""
    transcoders: tuple[str, ...]
    """One CLT file, or one transcoder file per MLP block (in block order)."""
    output: str
    """The directory the graphs are published into (replaced whole)."""
    prompts: str = ""
    """A text file (one prompt per line) or a parquet table; empty when a DataFrame is given."""
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
    rule: str = "topk"
    """The transcoders' inference rule: "topk" or "threshold"."""
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


def _loaded(config: GraphsConfig):
    """The replacement model (its tokenizer set), once per Python worker."""
    from ..circuits.replacement import ReplacementModel

    key = (config.model, config.transcoders, config.rule)
    if config.threads:
        import torch

        torch.set_num_threads(config.threads)
    if key not in _LOADED:
        _LOADED.clear()
        paths = config.transcoders[0] if len(config.transcoders) == 1 else list(config.transcoders)
        _LOADED[key] = ReplacementModel.load(config.model, paths, rule=config.rule)
    return _LOADED[key]


def graph_row(config: GraphsConfig, prompt_id: int, prompt: str | None) -> dict:
    """One prompt's row of ``SCHEMA`` (an error row when it cannot be attributed)."""
    from ..circuits.replacement import ReplacementError
    from .attribution import AttributionConfig, AttributionError, attribute
    from .graph import prune, scores

    row = dict.fromkeys(SCHEMA.names) | {"prompt_id": prompt_id, "prompt": prompt}
    replacement_model = _loaded(config)
    try:
        if not prompt or not prompt.strip():
            raise AttributionError("an empty prompt")
        ids = replacement_model.tokenizer(prompt)["input_ids"]
        attr = AttributionConfig(config.max_logits, config.logit_probability, config.batch_size,
                                 config.max_feature_nodes, config.update_interval)
        graph = attribute(replacement_model, ids, attr, prompt)
    except ReplacementError as e:  # the prompt's (an AttributionError) or its model's
        return row | {"status": "error", "error": str(e), "nodes": [], "edges": []}
    pruned = prune(graph, config.node_threshold, config.edge_threshold)
    replacement, completeness = scores(graph)
    return row | {
        "status": "ok", "error": None, "n_tokens": graph.n_pos, "n_features": graph.n_features,
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


def write_graph_files(root: str | os.PathLike, row: dict, token_text=None) -> None:
    """Writes an attributed prompt's files under ``root``: its nodes and pruned edges as
    ``nodes/prompt_id=N/part-0.parquet`` and ``edges/prompt_id=N/part-0.parquet``, and
    with ``token_text`` (a token id's text) the browser's ``data/graph-N.js``; each whole
    (a retried task replaces it)."""
    import pyarrow.parquet as pq

    from .page import graph_data

    def put(path: Path, write) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        write(tmp)
        os.replace(tmp, path)

    for name, struct in (("nodes", NODE), ("edges", EDGE)):
        if row[name]:
            schema = pa.schema([struct.field(i) for i in range(struct.num_fields)])
            table = pa.Table.from_pylist(row[name], schema)
            put(Path(root, name, f"prompt_id={row['prompt_id']}", "part-0.parquet"),
                lambda tmp, table=table: pq.write_table(table, tmp))  # fmt: skip
    if token_text is not None:
        text = graph_data(row, token_text)
        put(Path(root, "data", f"graph-{row['prompt_id']}.js"), lambda tmp: tmp.write_text(text))


def _graphs_fn(config: GraphsConfig, root: str):
    def run(batches):
        import gc

        tokenizer = _loaded(config).tokenizer
        # the worker's torch, transformers and model objects live as long as it does: out
        # of the collector's scans, which every graph's allocations trigger (~15% of a
        # small graph's time)
        gc.freeze()
        token_text = (lambda t: tokenizer.decode([t])) if config.browser else None
        for batch in batches:
            ids, texts = batch.column("prompt_id").to_pylist(), batch.column("prompt").to_pylist()
            for prompt_id, text in zip(ids, texts, strict=True):
                row = graph_row(config, prompt_id, text)
                if row["status"] == "ok":
                    write_graph_files(root, row, token_text)
                yield pa.RecordBatch.from_pylist([row], TASK_SCHEMA)

    return run


def numbered_prompts(spark, config: GraphsConfig, prompts=None):
    """``(prompt_id, prompt)`` in the prompts' order."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    if prompts is None:
        if not config.prompts:
            raise InvalidArgumentError("prompts: give a text file, a parquet table or a DataFrame")
        if config.prompts.endswith(".parquet") or Path(config.prompts).is_dir():
            prompts = spark.read.parquet(config.prompts)
        else:
            prompts = spark.read.text(config.prompts).withColumnRenamed("value", config.column)
    if config.column not in prompts.columns:
        raise InvalidArgumentError(
            f"the prompts have no column {config.column!r}: {prompts.columns}"
        )
    order = Window.orderBy(F.monotonically_increasing_id())
    return prompts.select(
        (F.row_number().over(order) - 1).cast("long").alias("prompt_id"),
        F.col(config.column).cast("string").alias("prompt"),
    )


def _write_index(graphs, root: Path, feature_pages: str = "") -> None:
    """The browser's pages and index (the graphs' data files are the tasks')."""
    from .page import index_files

    scalars = graphs.select(*[name for name, _ in SCALARS]).orderBy("prompt_id").collect()
    for name, text in index_files([r.asDict() for r in scalars], feature_pages).items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def _summary(graphs, config: GraphsConfig) -> dict:
    """The config, the counts, the refused prompts and the scores' mean and min."""
    from pyspark.sql import functions as F

    counts = {r["status"]: r["count"] for r in graphs.groupBy("status").count().collect()}
    errors = [r.asDict() for r in graphs.where("status = 'error'")
              .select("prompt_id", "prompt", "error").orderBy("prompt_id").collect()]  # fmt: skip
    names = ("replacement", "completeness")
    aggregates = {"mean": F.mean, "min": F.min}
    stats = (
        graphs.where("status = 'ok'")
        .agg(*(f(f"{n}_score").alias(f"{n}_{a}") for n in names for a, f in aggregates.items()))
        .first()
    )
    scores = {n: {"mean": stats[f"{n}_mean"], "min": stats[f"{n}_min"]} for n in names}
    return {"config": dataclasses.asdict(config), "graphs": counts.get("ok", 0),
            "failed": counts.get("error", 0), "errors": errors, "scores": scores}  # fmt: skip


def run_graphs(spark, config: GraphsConfig, prompts=None) -> dict:
    """Every prompt's graph, written as the module docstring says; returns the summary."""
    from pyspark.sql import functions as F
    from pyspark.sql.pandas.types import from_arrow_schema

    from ..dataset.publish import publishing
    from ..spark.register import register

    register(spark)
    numbered = numbered_prompts(spark, config, prompts)
    n = config.partitions or spark.sparkContext.defaultParallelism
    with publishing(config.output) as staging:
        staging = str(staging)
        # the tasks write each graph's nodes, edges and page data as they make it (a
        # Spark write partitioned by prompt cost more than the graphs: a file per prompt
        # committed, and every node through the JVM)
        graphs = (
            numbered.repartition(n, "prompt_id")
            .mapInArrow(_graphs_fn(config, staging), from_arrow_schema(TASK_SCHEMA))
            .persist()
        )
        try:
            scalars = graphs.select(*[name for name, _ in SCALARS]).orderBy("prompt_id")
            scalars.coalesce(1).write.parquet(os.path.join(staging, "graphs.parquet"))
            ok = graphs.where("status = 'ok'")
            tensor = F.struct(F.col("adjacency").alias("data"),
                              F.array(F.col("n_nodes"), F.col("n_nodes")).alias("shape"),
                              F.lit("F32").alias("dtype"))  # fmt: skip
            (ok.select(F.format_string("p%d", "prompt_id").alias("key"), tensor.alias("adjacency"))
             .write.format("safetensors").option("name_col", "key").mode("overwrite")
             .save(os.path.join(staging, "adjacency")))  # fmt: skip
            summary = _summary(graphs, config)
            if config.browser:
                _write_index(graphs, Path(staging), config.feature_pages)
        finally:
            graphs.unpersist()
        Path(staging, "graphs.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
