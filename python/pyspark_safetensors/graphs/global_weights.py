"""Global weights: which features drive which, in general rather than on one prompt
(Ameisen et al. 2025, "Circuit Tracing", section "Global weights").

**Virtual weights** (``virtual_weights``), of a CLT or per-layer transcoders, from their
weights alone. A source feature ``i`` of layer ``s`` writes ``W_dec^{s->t}[i]`` into the
residual stream at the output of every block ``t`` it decodes to (a per-layer transcoder:
its own block only); a target feature ``j`` of layer ``u`` reads the input of block ``u``
through ``W_enc^u[j]``. Through the residual stream alone the weight from one to the
other is

    V[(s, i) -> (u, j)] = sum over t with s <= t and block(t) < block(u) of  W_enc^u[j] . W_dec^{s->t}[i]

exact for the dictionary, with the model's **attention and normalisations left out**
(the path through attention, and the RMSNorm's scale and gain before ``W_enc``, are not
in it), and no skip path (a skip transcoder's linear path is no feature). Computed on one
process as one dense ``[n_s, n_u]`` block per (source layer, target layer), with the
decoders summed first (``sum_t W_dec^{s->t}``, one product per block). The full matrix
holds every pair of features in different layers: ``n^2 L (L - 1) / 2`` weights (0.4 M
for the CLT demo's 4 x 256 latents; 10^11 for Gemma-2-2B's 26 x 16k, far too many to
write). ``top_k > 0`` keeps, per target feature, its ``top_k`` inputs of largest
``|V|`` over every earlier layer and, per source feature, its ``top_k`` outputs in each
later layer (the union of both); ``top_k = 0`` keeps them all.

**Expected attributions** (``expected_attributions``), from a graph job's graphs
(``run_graphs``: each prompt's unpruned adjacency and its nodes), aggregated in Spark over
every prompt. ``A_p[(u, j, q) <- (s, i, r)]`` is the graph's edge from feature ``(s, i)``
at position ``r`` to feature ``(u, j)`` at position ``q`` of prompt ``p`` (its direct
effect, attention paths included; 0 where no edge), ``a_p(u, j, q)`` the target's
activation there. Summing over the source's positions, ``A_p(q) = sum_r A_p[(u, j, q) <- (s,
i, r)]``; then, for every pair of features active in one graph (source in an earlier
layer than the target):

- ``sum = sum_p sum_q A_p(q)``, the total attribution over the job;
- ``count`` = the prompts in which both are active (attributed features of its graph);
- ``mean = sum / count``, the mean attribution per such prompt;
- ``twera = sum_p sum_q a_p(u, j, q) A_p(q) / sum_p sum_q a_p(u, j, q)``: the
  target-weighted expected attribution, the paper's TWERA (its expectation over
  contexts weighted by the target's activation), the denominator over every position
  where the target is active in any graph of the job, with or without the source.

Each task reads its prompts' adjacencies and node tables itself (the bytes do not cross
the JVM) and emits one row per pair per prompt, and one per feature with its activation
summed (the TWERA's denominator); Spark sums them: memory flat in prompts.

Both outputs are parquet partitioned by the target's layer (``target_layer=L/``), read
in SQL as ``spark.read.parquet(out + "/virtual_weights")``, and go through the storage
layer to a local path or any URI ``DatasetLocation`` takes (``s3://``, ...; the graph job
may be on one too): each published whole (``dataset.publish.StagedOutput``), its summary
last (``_virtual_weights.json``, ``_expected_attributions.json``: names parquet readers
skip). The expected attributions' tasks write their parquet files themselves, streamed
into a spool file and uploaded, each attempt in a folder of its own; the driver publishes
the attempts whose results it collected (no Hadoop committer, no driver-local rename).

``feature_links`` turns both into each feature's strongest inputs and outputs, the data
a feature browser's page shows (``features/page.py``'s ``links_script``).
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..format.errors import InvalidArgumentError

VIRTUAL = "virtual_weights"
EXPECTED = "expected_attributions"
VIRTUAL_SCHEMA = pa.schema([("source_layer", pa.int32()), ("source_latent", pa.int32()),
                            ("target_latent", pa.int32()), ("weight", pa.float32())])  # fmt: skip
"""A ``virtual_weights/target_layer=L/`` file's columns (``target_layer`` is the folder's)."""
PAIR_SCHEMA = pa.schema([("target_layer", pa.int32()), ("target_latent", pa.int32()),
                         ("source_layer", pa.int32()), ("source_latent", pa.int32()),
                         ("sum", pa.float64()), ("weighted", pa.float64())])  # fmt: skip
"""The tasks' rows: one per (prompt, pair); ``weighted`` is ``sum_q a(q) A(q)``."""


@dataclass(frozen=True)
class VirtualWeights:
    """Virtual weights of a dictionary (module docstring)."""

    target_layers: tuple[int, ...]
    """The model block of each target layer, in order (the replacement's blocks)."""
    blocks: dict[int, dict[int, np.ndarray]]
    """``blocks[u][s]``: ``[n_s, n_u]`` float32, source layer ``s`` into target layer ``u``
    (replacement layer indices)."""


def virtual_weight_blocks(replacement, layers) -> dict[int, dict[int, np.ndarray]]:
    """``{u: {s: V [n_s, n_u]}}`` for each target layer ``u`` and source layer ``s`` with a
    path (module docstring); ``layers`` is the model block of each replacement layer."""
    import torch

    out: dict[int, dict[int, np.ndarray]] = {}
    with torch.no_grad():
        for u in range(replacement.n_layers):
            enc = replacement.encoder_weight[u].float()  # [n_u, d]
            per_source: dict[int, torch.Tensor] = {}
            for t in range(replacement.n_layers):
                if layers[t] >= layers[u]:
                    continue  # block t writes after block u reads
                for s, w in replacement.decoders[t].items():
                    per_source[s] = per_source.get(s, 0) + w.float()  # sum_t W_dec^{s->t}
            out[u] = {s: (d @ enc.t()).cpu().numpy() for s, d in sorted(per_source.items())}
    return out


def _top_k_mask(v: np.ndarray, k: int, axis: int) -> np.ndarray:
    """True at each row's (axis 1) or column's (axis 0) ``k`` largest ``|v|``."""
    if k <= 0 or k >= v.shape[axis]:
        return np.ones(v.shape, bool)
    a = np.abs(v)
    kth = -np.partition(-a, k - 1, axis=axis).take([k - 1], axis=axis)
    return a >= kth


def virtual_weights(model_dir: str, dictionary, out: str, *, top_k: int = 0, rule: str = "topk",
                    storage_options: Mapping[str, str] | None = None) -> dict:  # fmt: skip
    """The virtual weights of ``dictionary`` (a CLT, per-layer transcoders: anything
    ``circuits.load_replacement`` takes) in the model at ``model_dir``, written as
    ``{out}/virtual_weights/target_layer=L/part-0.parquet`` (``VIRTUAL_SCHEMA``; ``L``
    the model block), published whole with ``_virtual_weights.json`` last (a name parquet
    readers skip). ``top_k``: the pairs kept (module docstring; 0: all). Returns that
    summary."""
    from ..circuits.replacement import ReplacementModel
    from ..dataset import DatasetLocation
    from ..dataset.publish import staged_output
    from .job import parquet_bytes

    if top_k < 0:
        raise InvalidArgumentError(f"top_k must be >= 0 (0: every pair), got {top_k}")
    rm = ReplacementModel.load(model_dir, dictionary, rule=rule)
    layers = rm.layers
    blocks = virtual_weight_blocks(rm.replacement, layers)
    target = DatasetLocation.of(out, storage_options=dict(storage_options or {})).child(VIRTUAL)
    n_pairs = 0
    with staged_output(target, "_virtual_weights.json") as staged:
        for u, by_source in blocks.items():
            if not by_source:
                continue
            # a target's inputs compete across every source layer; a source's outputs per target layer
            stacked = np.concatenate(list(by_source.values()), axis=0)  # [sum n_s, n_u]
            keep = _top_k_mask(stacked, top_k, axis=0)
            parts, row = [], 0
            for s, v in by_source.items():
                mask = keep[row : row + len(v)] | _top_k_mask(v, top_k, axis=1)
                row += len(v)
                i, j = np.nonzero(mask)
                parts.append(pa.table({"source_layer": np.full(len(i), layers[s], np.int32),
                                       "source_latent": i.astype(np.int32),
                                       "target_latent": j.astype(np.int32),
                                       "weight": v[i, j].astype(np.float32)}, schema=VIRTUAL_SCHEMA))  # fmt: skip
            table = pa.concat_tables(parts)
            n_pairs += table.num_rows
            staged.staging.put_bytes(
                f"target_layer={layers[u]}/part-0.parquet", parquet_bytes(table)
            )
        summary = {"model": str(model_dir), "dictionary": str(dictionary), "top_k": top_k,
                   "pairs": n_pairs, "layers": list(layers),
                   "attention": "left out", "normalisations": "left out"}  # fmt: skip
        staged.staging.put_json("_virtual_weights.json", summary)
    return summary


# --- expected attributions ------------------------------------------------------------------


def prompt_pairs(nodes: pa.Table, adjacency: np.ndarray) -> pa.Table:
    """One prompt's rows of ``PAIR_SCHEMA``: each pair of its graph's features (source in
    an earlier layer), the attribution summed over both positions and weighted by the
    target's activation at each of its positions (module docstring)."""
    f = nodes.filter(pc.equal(nodes.column("kind"), "feature")).sort_by("node")
    idx = f.column("node").to_numpy()
    layer = f.column("layer").to_numpy().astype(np.int64)
    latent = f.column("latent").to_numpy().astype(np.int64)
    act = f.column("activation").to_numpy().astype(np.float64)
    if len(idx) == 0:
        return PAIR_SCHEMA.empty_table()
    sub = adjacency[np.ix_(idx, idx)].astype(np.float64)  # [target node, source node]
    key = layer << 32 | latent
    feats, which = np.unique(key, return_inverse=True)  # the prompt's distinct features
    onehot = np.zeros((len(idx), len(feats)))
    onehot[np.arange(len(idx)), which] = 1.0
    per_source = sub @ onehot  # [target node, source feature]: summed over source positions
    plain = onehot.T @ per_source  # [target feature, source feature]
    weighted = onehot.T @ (act[:, None] * per_source)
    f_layer = feats >> 32
    t, s = np.nonzero(f_layer[:, None] > f_layer[None, :])  # every pair both active, s earlier
    return pa.table({
        "target_layer": (feats[t] >> 32).astype(np.int32),
        "target_latent": (feats[t] & 0xFFFFFFFF).astype(np.int32),
        "source_layer": (feats[s] >> 32).astype(np.int32),
        "source_latent": (feats[s] & 0xFFFFFFFF).astype(np.int32),
        "sum": plain[t, s], "weighted": weighted[t, s],
    }, schema=PAIR_SCHEMA)  # fmt: skip


def _pairs_fn(graphs_uri: str, storage_options: Mapping[str, str]):
    """The tasks' function: each prompt's ``prompt_pairs`` rows and, with ``source_layer``
    -1, one row per feature of its graph whose ``weighted`` is its activation summed over
    its positions (the TWERA's denominator). Each adjacency is one ranged read at the
    place the dataset's tensor index names (not a memory map, whose pages a task would
    keep resident as it reads on: memory flat in prompts)."""

    def run(batches):
        from ..dataset import DatasetLocation
        from ..dataset.index import read_index
        from ..dataset.manifest import load_manifest

        src = DatasetLocation.of(graphs_uri, storage_options=dict(storage_options))
        adjacency = src.child("adjacency")
        manifest = load_manifest(adjacency)
        index = read_index(adjacency, manifest).to_pydict()
        column = f"{manifest.kv_separator or '__'}adjacency"  # p{prompt_id}__adjacency
        places = dict(zip(index["tensor_key"],
                          zip(index["file_name"], index["begin"], index["end"], strict=True),
                          strict=True))  # fmt: skip
        for batch in batches:
            for pid, n in zip(batch.column("prompt_id").to_pylist(), batch.column("n_nodes").to_pylist(),
                              strict=True):  # fmt: skip
                nodes = pq.read_table(
                    io.BytesIO(src.read_bytes(f"nodes/prompt_id={pid}/part-0.parquet"))
                )
                name, begin, end = places[f"p{pid}{column}"]
                a = np.frombuffer(adjacency.read_range(name, begin, end), "<f4").reshape(n, n)
                table = prompt_pairs(nodes, a)
                if table.num_rows:
                    yield from table.to_batches()
                totals = activation_totals(nodes)
                if totals.num_rows:
                    yield from totals.to_batches()

    return run


def activation_totals(nodes: pa.Table) -> pa.Table:
    """One prompt's features, each a ``PAIR_SCHEMA`` row of ``source_layer`` -1 whose
    ``weighted`` is its activation summed over its positions."""
    f = nodes.filter(pc.equal(nodes.column("kind"), "feature"))
    if not f.num_rows:
        return PAIR_SCHEMA.empty_table()
    g = f.group_by(["layer", "latent"]).aggregate([("activation", "sum")])
    n = g.num_rows
    return pa.table({
        "target_layer": g.column("layer").cast(pa.int32()),
        "target_latent": g.column("latent").cast(pa.int32()),
        "source_layer": np.full(n, -1, np.int32), "source_latent": np.full(n, -1, np.int32),
        "sum": np.zeros(n), "weighted": g.column("activation_sum").cast(pa.float64()),
    }, schema=PAIR_SCHEMA)  # fmt: skip


EXPECTED_SCHEMA = pa.schema([("target_latent", pa.int32()), ("source_layer", pa.int32()),
                             ("source_latent", pa.int32()), ("sum", pa.float64()),
                             ("count", pa.int64()), ("mean", pa.float64()),
                             ("twera", pa.float64())])  # fmt: skip
"""An ``expected_attributions/target_layer=L/`` file's columns."""
WRITTEN_SCHEMA = pa.schema([("staged", pa.string()), ("name", pa.string()), ("rows", pa.int64())])
"""The writing tasks' rows: each file an attempt wrote (``staged``, under its folder), its
name in the output and its rows."""


def _write_fn(staging):
    """The writing tasks' function: the rows of its partition (sorted by target layer),
    a file per layer under this attempt's folder of ``staging``, written batch by batch
    (``write_shard``: into a spool file uploaded in one stream on an object store); yields
    each file's staged name, its name in the output (``target_layer=L/part-P.parquet``)
    and its rows."""
    from ..dataset.publish import attempt_folder
    from .job import _attempt_tag

    def run(batches):
        from pyspark import TaskContext

        context = TaskContext.get()
        part = context.partitionId() if context is not None else 0
        folder = attempt_folder(_attempt_tag())
        mine = staging.child(folder)
        pieces = _layer_pieces(batches)
        piece = next(pieces, None)
        while piece is not None:
            layer = piece[0]
            name = f"target_layer={layer}-part-{part:05d}.parquet"  # a flat name: a shard's
            rows = 0

            def write(path: str, layer: int = layer) -> None:
                nonlocal piece, rows
                with pq.ParquetWriter(path, EXPECTED_SCHEMA) as writer:
                    while piece is not None and piece[0] == layer:
                        writer.write_table(piece[1].cast(EXPECTED_SCHEMA))  # nullability
                        rows += piece[1].num_rows
                        piece = next(pieces, None)

            mine.write_shard(name, write)
            final = f"target_layer={layer}/part-{part:05d}.parquet"
            yield pa.RecordBatch.from_pylist([{"staged": f"{folder}/{name}", "name": final,
                                               "rows": rows}], WRITTEN_SCHEMA)  # fmt: skip

    return run


def _layer_pieces(batches):
    """``(target_layer, rows)`` of batches sorted by ``target_layer``: a batch cut where its
    layer changes."""
    for batch in batches:
        table = pa.Table.from_batches([batch])
        layers = table.column("target_layer").to_numpy()
        cuts = np.flatnonzero(np.diff(layers)) + 1
        for lo, hi in zip([0, *cuts], [*cuts, len(layers)], strict=True):
            yield int(layers[lo]), table.slice(lo, hi - lo).drop_columns(["target_layer"])


def expected_attributions(spark, graphs: str, out: str, *, partitions: int = 0,
                          storage_options: Mapping[str, str] | None = None) -> dict:  # fmt: skip
    """The expected attributions over every graph of the job at ``graphs`` (module
    docstring; a local path or a URI), written as ``{out}/expected_attributions/``
    partitioned by ``target_layer``: ``EXPECTED_SCHEMA``, published whole with
    ``_expected_attributions.json`` last. Returns that summary (graphs, pairs)."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F
    from pyspark.sql.pandas.types import from_arrow_schema

    from ..dataset import DatasetLocation
    from ..dataset.publish import staged_output
    from ..spark.compat import default_parallelism, from_arrow
    from .job import PROMPTS_TABLE, SUMMARY

    options = dict(storage_options or {})
    src = DatasetLocation.of(graphs, storage_options=options)
    if not src.has(SUMMARY):
        raise InvalidArgumentError(f"{src.display(SUMMARY)}: not a finished graph job's output")
    prompts = pq.read_table(io.BytesIO(src.read_bytes(PROMPTS_TABLE)))
    ok = prompts.filter(pc.equal(prompts.column("status"), "ok")).select(["prompt_id", "n_nodes"])
    n = partitions or default_parallelism(spark)
    rows = (from_arrow(spark, ok).repartition(n, "prompt_id")
            .mapInArrow(_pairs_fn(src.uri, options), from_arrow_schema(PAIR_SCHEMA)))  # fmt: skip
    key = ["target_layer", "target_latent", "source_layer", "source_latent"]
    pairs = rows.groupBy(*key).agg(F.sum("sum").alias("sum"), F.count("*").alias("count"),
                                   F.sum("weighted").alias("weighted"))  # fmt: skip
    # each target's activation total (its source_layer -1 row) beside each of its pairs
    target = Window.partitionBy("target_layer", "target_latent")
    total = F.max(F.when(F.col("source_layer") < 0, F.col("weighted"))).over(target)
    result = (pairs.withColumn("target_activation", total).where("source_layer >= 0")
              .select(*key, "sum", "count", (F.col("sum") / F.col("count")).alias("mean"),
                      (F.col("weighted") / F.col("target_activation")).alias("twera"))
              .repartition(n, "target_layer").sortWithinPartitions("target_layer"))  # fmt: skip
    final = DatasetLocation.of(out, storage_options=options).child(EXPECTED)
    marker = f"_{EXPECTED}.json"
    with staged_output(final, marker) as staged:
        written = (result.mapInArrow(_write_fn(staged.staging), from_arrow_schema(WRITTEN_SCHEMA))
                   .collect())  # fmt: skip
        n_pairs = 0
        for row in written:
            staged.adopt(row["staged"], row["name"])
            n_pairs += row["rows"]
        summary = {"graphs": ok.num_rows, "pairs": n_pairs, "out": final.uri,
                   "files": len(written)}  # fmt: skip
        staged.staging.put_json(marker, {**summary, "graphs_job": src.uri})
    return summary


def strongest_pairs(out: str, n: int = 8, *,
                    storage_options: Mapping[str, str] | None = None) -> dict[str, list[dict]]:  # fmt: skip
    """The ``n`` pairs of largest ``|weight|`` of ``{out}/virtual_weights`` and of largest
    ``|sum|`` of ``{out}/expected_attributions`` (the total over the graphs: a TWERA
    ranks one target's inputs, but across targets it favours those that rarely fire)
    (each that is there), for a report:
    ``{"virtual_weights": [row, ...], "expected_attributions": [...]}``."""
    found = {}
    for name, column in ((VIRTUAL, "weight"), (EXPECTED, "sum")):
        table = _read(out, name, storage_options)
        if table is None or not table.num_rows:
            continue
        order = np.argsort(-np.abs(np.nan_to_num(table.column(column).to_numpy())), kind="stable")
        found[name] = table.take(order[:n]).to_pylist()
    return found


def _read(out: str, name: str, storage_options) -> pa.Table | None:
    """``{out}/{name}`` (a finished output: its marker there) as one table with its
    ``target_layer`` column, else None."""
    import pyarrow.dataset as pads

    from ..dataset import DatasetLocation

    where = DatasetLocation.of(out, storage_options=dict(storage_options or {})).child(name)
    if not where.has(f"_{name}.json"):
        return None
    data = pads.dataset(where.root, filesystem=where.fs, format="parquet",
                        partitioning=pads.partitioning(pa.schema([("target_layer", pa.int32())]),
                                                       flavor="hive"))  # fmt: skip
    return data.to_table()


def feature_links(
    out: str, top: int = 5, *, storage_options: Mapping[str, str] | None = None
) -> dict[int, dict]:
    """Each feature's strongest inputs and outputs, by layer (the model block), for the
    feature browsers' pages: ``{layer: {latent: {"inputs": {...}, "outputs": {...}}}}``,
    each ``{"virtual": [[layer, latent, weight], ...], "expected": [[layer, latent, twera,
    count], ...]}``: the ``top`` of largest ``|weight|`` (``|twera|``) among the virtual
    weights and the expected attributions at ``out`` (those that are there); a feature
    with none is left out."""
    links: dict[int, dict] = {}

    def add(table: pa.Table, kind: str, value: str, extra: tuple[str, ...]) -> None:
        cols = {c: table.column(c).to_numpy() for c in
                ("source_layer", "source_latent", "target_layer", "target_latent", value, *extra)}  # fmt: skip
        strength = np.abs(np.nan_to_num(cols[value].astype(np.float64)))
        for side, me, other in (("inputs", "target", "source"), ("outputs", "source", "target")):
            layer, latent = cols[f"{me}_layer"], cols[f"{me}_latent"]
            # by feature, strongest first: one sort, then each feature's first ``top``
            order = np.lexsort((-strength, latent, layer))
            key = (layer[order].astype(np.int64) << 32) | latent[order].astype(np.int64)
            starts = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
            rank = np.arange(len(key)) - np.repeat(starts, np.diff(np.r_[starts, len(key)]))
            for i in order[rank < top]:
                entry = links.setdefault(int(layer[i]), {}).setdefault(int(latent[i]), {})
                row = [int(cols[f"{other}_layer"][i]), int(cols[f"{other}_latent"][i]),
                       float(f"{float(cols[value][i]):.4g}")]  # fmt: skip
                row += [int(cols[c][i]) for c in extra]
                entry.setdefault(side, {}).setdefault(kind, []).append(row)

    for name, kind, value, extra in ((VIRTUAL, "virtual", "weight", ()),
                                     (EXPECTED, "expected", "twera", ("count",))):  # fmt: skip
        table = _read(out, name, storage_options)
        if table is not None and table.num_rows:
            add(table, kind, value, extra)
    return links


@dataclass(frozen=True)
class GlobalWeightsConfig:
    """Global weights of a dictionary and/or over a graph job's graphs."""

    out: str
    """The output directory: ``virtual_weights/`` and ``expected_attributions/``."""
    graphs: str = ""
    """A graph job's output (a local path or a URI): its expected attributions are
    computed, and its model and dictionary are the default ones; empty: virtual weights
    only."""
    model: str = ""
    """The model directory (default: the graph job's)."""
    transcoders: tuple[str, ...] = ()
    """A CLT file, or one transcoder file per block (default: the graph job's)."""
    top_k: int = 0
    """Virtual weights kept per feature (module docstring); 0: every pair."""
    rule: str = "topk"
    """The dictionary's rule ("topk" or "threshold"; the weights do not depend on it)."""
    partitions: int = 0
    """Tasks of the expected attributions (0: Spark's default parallelism)."""

    def __post_init__(self):
        if self.top_k < 0:
            raise InvalidArgumentError(f"top_k must be >= 0 (0: every pair), got {self.top_k}")


def run_global_weights(spark, config: GlobalWeightsConfig, *,
                       storage_options: Mapping[str, str] | None = None) -> dict:  # fmt: skip
    """Virtual weights (when a model and dictionary are known) and expected attributions
    (when ``graphs`` is given) into ``config.out`` (a local path or a URI, as
    ``graphs``); returns both summaries."""
    import json

    from ..dataset import DatasetLocation
    from .job import SUMMARY

    model, transcoders = config.model, tuple(config.transcoders)
    if config.graphs:
        src = DatasetLocation.of(config.graphs, storage_options=dict(storage_options or {}))
        if not src.has(SUMMARY):
            raise InvalidArgumentError(f"{src.display(SUMMARY)}: not a finished graph job's output")
        job = json.loads(src.read_bytes(SUMMARY))["config"]
        model = model or job["model"]
        transcoders = transcoders or tuple(job["transcoders"])
    if not (model and transcoders) and not config.graphs:
        raise InvalidArgumentError("give a graph job (--graphs), or a model and its transcoders")
    out = {}
    if model and transcoders:
        dictionary = transcoders[0] if len(transcoders) == 1 else list(transcoders)
        out["virtual_weights"] = virtual_weights(model, dictionary, config.out, top_k=config.top_k,
                                                 rule=config.rule,
                                                 storage_options=storage_options)  # fmt: skip
    if config.graphs:
        out["expected_attributions"] = expected_attributions(spark, config.graphs, config.out,
                                                             partitions=config.partitions,
                                                             storage_options=storage_options)  # fmt: skip
    return out
