"""A graph job's graphs as the field's graph viewers read them: circuit-tracer's graph JSON,
which Neuronpedia's graph viewer takes as it is (``metadata``, ``qParams``, ``nodes``,
``links``; Neuronpedia publishes its schema, ``tests/data/neuronpedia-graph-schema.json``).

One file per attributed prompt, ``{slug}.json`` (slug ``{prefix}-{prompt_id}``), and
``graph-metadata.json`` (``{"graphs": [each graph's metadata]}``), the directory layout
circuit-tracer's ``create_graph_files`` writes and its local server
(``circuit_tracer.frontend.local_server.serve(data_dir=...)``) serves; one file is what
Neuronpedia's upload (``neuronpedia.np_graph_metadata.NPGraphMetadata.upload_file``)
takes.

What a graph holds, as circuit-tracer's ``create_graph_files`` makes it from its own
graph: the pruned graph's nodes (the job's ``kept``) and edges, then only the nodes some
kept edge touches, and every embedding and logit node. Node ids as circuit-tracer names
them (``graph_models.Node``):

| node | ``node_id`` | ``feature`` | ``layer`` | ``jsNodeId`` |
|---|---|---|---|---|
| feature (layer l, latent f, position p) | ``{l}_{f}_{p}`` | Cantor pairing of (l, f) | ``"l"`` | ``{l}_{f}-0`` |
| error (block l, position p) | ``{l}_-1_{p}`` | -1 | ``"l"`` | ``{l}_-1-{p}`` |
| embedding (token t at p) | ``E_{t}_{p}`` | p | ``"E"`` | ``E_{t}-{p}`` |
| logit (token t) | ``{L+1}_{t}_{P-1}`` | t | ``"L+1"`` | ``L_{t}-{P-1}`` |

with L the model's layers and P the prompt's positions. Error nodes are named as
circuit-tracer's main branch and Neuronpedia's own graphs name them: circuit-tracer
0.5.0 wrote ``0_{l}_{p}``, which is also the id of layer 0's feature ``l`` at ``p``.
A feature's ``feature`` is the index its feature JSON is found by
(``feature_json_base_url/{feature}.json``). ``influence`` is the node's cumulative
influence share (the job's ``influence``; none for logits, as circuit-tracer), a
feature's ``activation`` its activation, ``clerp`` its label where ``labels`` gives one,
a logit's ``Output "token" (p=...)``. A graph written before the job recorded each
logit's probability (``nodes.probability``) has them recomputed from the model
(``probabilities="model"``).

    export_graphs(GraphExportConfig(graphs="out/graphs", out="out/graph-json", scan="toy-llama"))
"""

from __future__ import annotations

import io
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .._version import __version__
from ..format.errors import InvalidArgumentError

METADATA = "graph-metadata.json"
"""The index of the exported graphs, written last (circuit-tracer's name)."""
FEATURE_TYPE = "cross layer transcoder"
"""circuit-tracer's ``feature_type`` of a feature node, for CLTs and per-layer
transcoders alike."""
ERROR_TYPE = "mlp reconstruction error"
NODE_FIELDS = ("node_id", "feature", "layer", "ctx_idx", "feature_type", "token_prob",
               "is_target_logit", "run_idx", "reverse_ctx_idx", "jsNodeId", "clerp",
               "influence", "activation")  # fmt: skip
"""A node's keys, in the order of circuit-tracer's ``graph_models.Node``."""


def cantor(layer: int, latent: int) -> int:
    """circuit-tracer's feature index of (layer, latent): Cantor pairing."""
    return (layer + latent) * (layer + latent + 1) // 2 + latent


@dataclass(frozen=True)
class GraphExportConfig:
    """Export a graph job's graphs as circuit-tracer's / Neuronpedia's graph JSON."""

    graphs: str
    """A graph job's output (``run_graphs``): a local path or a URI."""
    out: str
    """The directory written (replaced whole): ``{slug}.json`` per graph and
    ``graph-metadata.json``; a local path or a URI."""
    scan: str = ""
    """``metadata.scan``: what Neuronpedia takes as the model id (e.g. ``gemma-2-2b``);
    empty: the model directory's name."""
    slug_prefix: str = "prompt"
    """Each graph's slug is ``{slug_prefix}-{prompt_id}``."""
    labels: str = ""
    """A table of feature labels (parquet, or JSON lines) with columns ``layer``,
    ``latent``, ``label``: a feature node's ``clerp``; empty: none."""
    feature_json_base_url: str = ""
    """``metadata.feature_details.feature_json_base_url``: where Neuronpedia's viewer
    fetches ``{feature}.json``, feature JSON files in Anthropic's format that you host
    (``feature`` a node's Cantor index); empty: none."""
    neuronpedia_source_set: str = ""
    """``metadata.feature_details.neuronpedia_source_set``: the source set on Neuronpedia
    the features are; empty: none."""
    n_layers: int = 0
    """The model's layer count (a logit node's layer is ``n_layers + 1``); 0: read from
    the model's ``config.json``."""
    model: str = ""
    """The model directory (its tokenizer decodes the tokens, and its config gives the
    layers); empty: the one the graph job recorded in ``graphs.json``."""
    features: tuple[str, ...] = ()
    """Feature job outputs (``pyspark-safetensors features``) of the graphs' dictionary, one
    per layer in order (a CLT's: each run with its ``clt_layer``), or one path holding
    ``{layer}`` (``out/features/layer{layer}``): each feature node's feature JSON is
    written as ``features/{feature}.json`` (``features.neuronpedia.feature_json``); a layer
    without one (an empty entry, a missing directory) is listed in the summary's
    ``features_missing``. Empty: none."""
    feature_logits: bool = True
    """The feature JSONs' ``top_logits`` / ``bottom_logits`` from the model's unembedding."""

    def __post_init__(self):
        if not self.slug_prefix or "/" in self.slug_prefix:
            raise InvalidArgumentError(f"slug_prefix: a name without '/', got {self.slug_prefix!r}")
        if self.n_layers < 0:
            raise InvalidArgumentError(f"n_layers must be >= 0, got {self.n_layers}")


def _read_parquet(where, name: str) -> pa.Table:
    return pq.read_table(io.BytesIO(where.read_bytes(name)))


def graph_json(nodes: pa.Table, edges: pa.Table, *, prompt: str, slug: str, scan: str,
               n_layers: int, token_text, labels: Mapping[tuple[int, int], str] | None = None,
               probabilities: Mapping[int, float] | None = None,
               metadata: Mapping | None = None) -> dict:  # fmt: skip
    """One graph as circuit-tracer's ``graph_models.Model`` dumps it (module docstring).
    ``nodes``/``edges``: the job's tables of one prompt; ``token_text(id)``: a token's
    text; ``probabilities``: each logit token's probability where ``nodes`` has no
    ``probability`` column; ``metadata``: keys added to ``metadata``."""
    labels = labels or {}
    rows = nodes.sort_by("node").to_pylist()
    P = sum(r["kind"] == "embedding" for r in rows)
    out: dict[int, dict] = {}
    first_logit = True
    for r in rows:
        if not r["kept"]:
            continue
        kind, layer, pos = r["kind"], r["layer"], r["pos"]
        node = {"token_prob": 0.0, "is_target_logit": False, "run_idx": 0, "reverse_ctx_idx": 0,
                "clerp": "", "influence": r["influence"], "activation": None}  # fmt: skip
        if kind == "feature":
            latent = r["latent"]
            node |= {"node_id": f"{layer}_{latent}_{pos}", "feature": cantor(layer, latent),
                     "layer": str(layer), "ctx_idx": pos, "feature_type": FEATURE_TYPE,
                     "jsNodeId": f"{layer}_{latent}-0", "activation": r["activation"],
                     "clerp": labels.get((layer, latent), "")}  # fmt: skip
        elif kind == "error":
            node |= {"node_id": f"{layer}_-1_{pos}", "feature": -1, "layer": str(layer),
                     "ctx_idx": pos, "feature_type": ERROR_TYPE, "jsNodeId": f"{layer}_-1-{pos}"}  # fmt: skip
        elif kind == "embedding":
            t = r["token"]
            node |= {"node_id": f"E_{t}_{pos}", "feature": pos, "layer": "E", "ctx_idx": pos,
                     "feature_type": "embedding", "jsNodeId": f"E_{t}-{pos}"}  # fmt: skip
        else:  # a logit, of the last position
            t = r["token"]
            p = r.get("probability")
            if p is None:
                if probabilities is None or t not in probabilities:
                    raise InvalidArgumentError(
                        f"{slug}: the graph records no probability of logit {t}; "
                        "give the model (probabilities are recomputed from it)"
                    )
                p = probabilities[t]
            last, layer_name = P - 1, str(n_layers + 1)
            node |= {"node_id": f"{layer_name}_{t}_{last}", "feature": int(t), "layer": layer_name,
                     "ctx_idx": last, "feature_type": "logit", "token_prob": float(p),
                     "is_target_logit": first_logit, "jsNodeId": f"L_{t}-{last}",
                     "clerp": f'Output "{token_text(t)}" (p={float(p):.3f})', "influence": None}  # fmt: skip
            first_logit = False
        out[r["node"]] = {k: node[k] for k in NODE_FIELDS}
    links = []
    if edges.num_rows:
        e = edges.sort_by([("target", "ascending"), ("source", "ascending")])
        for s, t, w in zip(*(e.column(c).to_pylist() for c in ("source", "target", "weight")),
                           strict=True):  # fmt: skip
            if s in out and t in out:
                links.append({"source": out[s]["node_id"], "target": out[t]["node_id"],
                              "weight": float(w)})  # fmt: skip
    touched = {x for link in links for x in (link["source"], link["target"])}
    used = [n for n in out.values()
            if n["node_id"] in touched or n["feature_type"] in ("embedding", "logit")]  # fmt: skip
    tokens = [r["token"] for r in rows if r["kind"] == "embedding"]
    meta = {"slug": slug, "scan": scan, "transcoder_list": [],
            "prompt_tokens": [token_text(t) for t in tokens], "prompt": prompt,
            "schema_version": 1, **(metadata or {})}  # fmt: skip
    qparams = {"pinnedIds": [], "supernodes": [], "linkType": "both", "clickedId": "", "sg_pos": ""}
    return {"metadata": meta, "qParams": qparams, "nodes": used, "links": links}


def _model_dir(config: GraphExportConfig, job_config: dict) -> str:
    model = config.model or job_config.get("model", "")
    if not model or not Path(model).joinpath("config.json").is_file():
        raise InvalidArgumentError(
            f"model: {model!r} is not a local model directory (the tokenizer decodes the "
            "graphs' tokens); give --model"
        )
    return model


def logit_probabilities(model, tokens: list[int], logit_tokens: list[int]) -> dict[int, float]:
    """The model's next-token probabilities of ``logit_tokens`` after ``tokens`` (for
    graphs written before the job recorded them)."""
    import torch

    with torch.inference_mode():
        logits = model(torch.tensor([tokens])).logits[0, -1].double()
    probs = torch.softmax(logits, -1)
    return {t: float(probs[t]) for t in logit_tokens}


def _metadata(config: GraphExportConfig, job: dict) -> dict:
    """The graph JSON's ``metadata`` beyond the prompt's: the job's settings, the generator."""
    details = {k: v for k, v in (("feature_json_base_url", config.feature_json_base_url),
                                 ("neuronpedia_source_set", config.neuronpedia_source_set)) if v}  # fmt: skip
    return {
        "node_threshold": job["node_threshold"],
        "info": {"generator": {"name": "pyspark-safetensors", "version": __version__},
                 "source_urls": list(job.get("transcoders", [])),
                 "create_time_ms": int(time.time() * 1000)},
        "generation_settings": {"max_n_logits": job["max_logits"],
                                "desired_logit_prob": job["logit_probability"],
                                "batch_size": job["batch_size"],
                                "max_feature_nodes": job.get("max_feature_nodes", 0)},
        "pruning_settings": {"node_threshold": job["node_threshold"],
                             "edge_threshold": job["edge_threshold"]},
        **({"feature_details": details} if details else {}),
    }  # fmt: skip


def _logit_probabilities_of(model, nodes: pa.Table) -> dict[int, float]:
    """``logit_probabilities`` of a graph's nodes table: its prompt (the embedding nodes'
    tokens, in node order) and its logit tokens."""
    kinds = np.asarray(nodes.column("kind").to_pylist())
    order = np.argsort(nodes.column("node").to_numpy())
    tok = np.asarray(nodes.column("token").to_pylist(), dtype=object)[order]
    kinds = kinds[order]
    return logit_probabilities(model, [int(t) for t in tok[kinds == "embedding"]],
                               [int(t) for t in tok[kinds == "logit"]])  # fmt: skip


def export_graphs(config: GraphExportConfig, *,
                  storage_options: Mapping[str, str] | None = None) -> dict:  # fmt: skip
    """Every attributed prompt of ``config.graphs`` as ``{slug}.json`` in ``config.out``,
    ``graph-metadata.json`` last, with ``features`` each feature node's feature JSON in
    ``features/``; the directory is published whole. Returns ``{"graphs": n, "out": ...,
    "slugs": [...]}`` (and ``features``, ``features_missing`` with ``features``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..dataset import DatasetLocation
    from ..dataset.publish import staged_output
    from ..features.neuronpedia import read_labels
    from .job import PROMPTS_TABLE, SUMMARY

    options = dict(storage_options or {})
    src = DatasetLocation.of(config.graphs, storage_options=options)
    if not src.has(SUMMARY):
        raise InvalidArgumentError(
            f"{src.display(SUMMARY)}: not a finished graph job's output (run `pyspark-safetensors graphs`)"
        )
    job = json.loads(src.read_bytes(SUMMARY))["config"]
    model_dir = _model_dir(config, job)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    n_layers = config.n_layers or int(
        json.loads(Path(model_dir, "config.json").read_text())["num_hidden_layers"]
    )
    scan = config.scan or Path(model_dir).name
    labels = read_labels(config.labels)
    extra = _metadata(config, job)
    prompts = _read_parquet(src, PROMPTS_TABLE).to_pylist()
    model, slugs, metas, docs = None, [], [], []
    target = DatasetLocation.of(config.out, storage_options=options)
    with staged_output(target, METADATA) as out:
        for row in prompts:
            if row["status"] != "ok":
                continue
            pid = row["prompt_id"]
            nodes = _read_parquet(src, f"nodes/prompt_id={pid}/part-0.parquet")
            edge_file = f"edges/prompt_id={pid}/part-0.parquet"
            edges = (_read_parquet(src, edge_file) if src.has(edge_file)
                     else pa.table({"source": [], "target": [], "weight": []}))  # fmt: skip
            probabilities = None
            if "probability" not in nodes.column_names:  # a job from before the column
                model = (
                    model
                    or AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
                )
                probabilities = _logit_probabilities_of(model, nodes)
            slug = f"{config.slug_prefix}-{pid}"
            doc = graph_json(nodes, edges, prompt=row["prompt"], slug=slug, scan=scan,
                             n_layers=n_layers, token_text=lambda t: tokenizer.decode([t]),
                             labels=labels, probabilities=probabilities, metadata=extra)  # fmt: skip
            out.staging.put_bytes(f"{slug}.json", json.dumps(doc).encode())
            slugs.append(slug)
            metas.append(doc["metadata"])
            docs.append(doc)
        written, missing = _feature_files(config, docs, out.staging, model_dir, n_layers,
                                          options)  # fmt: skip
        out.staging.put_json(METADATA, {"graphs": metas})
    summary = {"graphs": len(slugs), "out": config.out, "slugs": slugs}
    if config.features:
        summary |= {"features": written, "features_missing": missing}
    return summary


def feature_nodes(doc: dict) -> set[tuple[int, int]]:
    """The ``(layer, latent)`` of a graph JSON's feature nodes."""
    return {(int(n["layer"]), int(n["node_id"].split("_")[1]))
            for n in doc["nodes"] if n["feature_type"] == FEATURE_TYPE}  # fmt: skip


def _browser_paths(features: tuple[str, ...], n_layers: int) -> list[str]:
    if len(features) == 1 and "{layer}" in features[0]:
        return [features[0].format(layer=layer) for layer in range(n_layers)]
    return list(features)


def _feature_files(config: GraphExportConfig, docs: list[dict], staging, model_dir: str,
                   n_layers: int, options: dict) -> tuple[int, list[int]]:  # fmt: skip
    """``features/{feature}.json`` of every feature node of ``docs``, from the browsers of
    ``config.features``; returns ``(files written, layers with features but no browser)``."""
    if not config.features:
        return 0, []
    from ..dataset import DatasetLocation
    from ..features.job import FEATURES_DOC
    from ..features.neuronpedia import feature_jsons, read_browser

    wanted: dict[int, set[int]] = {}
    for doc in docs:
        for layer, latent in feature_nodes(doc):
            wanted.setdefault(layer, set()).add(latent)
    paths = _browser_paths(config.features, n_layers)
    written, missing = 0, []
    for layer in sorted(wanted):
        path = paths[layer] if layer < len(paths) else ""
        if not path or not DatasetLocation.of(path, storage_options=options).has(FEATURES_DOC):
            missing.append(layer)
            continue
        browser = read_browser(path, options)
        if browser.clt_layer not in (-1, layer):
            raise InvalidArgumentError(
                f"features: {path} is layer {browser.clt_layer}'s browser, given for layer {layer}"
            )
        files = feature_jsons(browser, wanted[layer], index_of=lambda f, layer=layer: cantor(layer, f),
                              transcoder_id=Path(browser.doc["sae"]).name,
                              model_dir=model_dir if config.feature_logits else "")  # fmt: skip
        for doc in files.values():
            staging.put_bytes(f"features/{doc['index']}.json", json.dumps(doc).encode())
        written += len(files)
    return written, missing
