"""The graph job's graphs exported as circuit-tracer's / Neuronpedia's graph JSON: every
file valid against Neuronpedia's published schema (vendored, ``data/README.md``), the
ids following the conventions of a graph Neuronpedia's server wrote (vendored too), the
nodes and links the job's pruned graph, the logits' probabilities the model's; and, with
``.venv-circuit-tracer``, circuit-tracer's own pydantic models read every file back
unchanged."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import jsonschema
import numpy as np
import pyarrow.parquet as pq
import pytest

from conftest import GRAPH_PROMPTS
from pyspark_safetensors.format.errors import InvalidArgumentError
from pyspark_safetensors.graphs.export import GraphExportConfig, cantor, export_graphs

pytestmark = pytest.mark.spark

DATA = Path(__file__).parent / "data"
ROOT = Path(__file__).resolve().parents[2]
CT_PYTHON = ROOT / ".venv-circuit-tracer" / "bin" / "python"


def _validator():
    schema = json.loads((DATA / "neuronpedia-graph-schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def _uncantor(z: int) -> tuple[int, int]:
    w = int((np.sqrt(8 * z + 1) - 1) // 2)
    y = z - w * (w + 1) // 2
    return w - y, y


def _id_of(node: dict) -> str:
    """A node's id rebuilt from its other fields by the peer file's conventions."""
    kind, layer, pos = node["feature_type"], node["layer"], node["ctx_idx"]
    if kind == "cross layer transcoder":
        lay, latent = _uncantor(node["feature"])
        assert str(lay) == layer
        return f"{layer}_{latent}_{pos}"
    if kind == "mlp reconstruction error":
        return f"{layer}_-1_{pos}"
    if kind == "embedding":
        return f"E_{node['jsNodeId'][2:].split('-')[0]}_{pos}"
    return f"{layer}_{node['feature']}_{pos}"


def test_the_peer_graph_passes_the_schema_and_our_id_rules():
    validator = _validator()
    peer = json.loads((DATA / "neuronpedia-graph-123-clt-hp.json").read_text())
    validator.validate(peer)
    assert [_id_of(n) for n in peer["nodes"]] == [n["node_id"] for n in peer["nodes"]]
    assert cantor(0, 18753) == 175865634  # the peer's feature index of 0_18753_3
    broken = {
        **peer,
        "nodes": [{k: v for k, v in n.items() if k != "clerp"} for n in peer["nodes"]],
    }
    assert list(validator.iter_errors(broken))  # the schema does refuse a node without clerp


def test_graph_json_of_every_graph(graph_job, toy, tmp_path):
    labels = tmp_path / "labels.jsonl"
    nodes0 = pq.read_table(graph_job / "nodes" / "prompt_id=0").to_pylist()
    kept_feature = next(n for n in nodes0 if n["kind"] == "feature" and n["kept"])
    labels.write_text(json.dumps({"layer": kept_feature["layer"], "latent": kept_feature["latent"],
                                  "label": "a labelled latent"}) + "\n")  # fmt: skip
    out = tmp_path / "json"
    config = GraphExportConfig(graphs=str(graph_job), out=str(out), scan="toy-llama",
                               labels=str(labels), feature_json_base_url="https://x/features")  # fmt: skip
    summary = export_graphs(config)
    ok = [i for i, p in enumerate(GRAPH_PROMPTS) if p]
    assert summary["slugs"] == [f"prompt-{i}" for i in ok]
    index = json.loads((out / "graph-metadata.json").read_text())
    assert [g["slug"] for g in index["graphs"]] == summary["slugs"]
    validator = _validator()
    config_doc = json.loads((Path(toy) / "config.json").read_text())
    for pid in ok:
        doc = json.loads((out / f"prompt-{pid}.json").read_text())
        validator.validate(doc)
        meta = doc["metadata"]
        assert meta["prompt"] == GRAPH_PROMPTS[pid] and meta["scan"] == "toy-llama"
        assert meta["feature_details"] == {"feature_json_base_url": "https://x/features"}
        nodes = pq.read_table(graph_job / "nodes" / f"prompt_id={pid}").to_pylist()
        edges = pq.read_table(graph_job / "edges" / f"prompt_id={pid}").to_pylist()
        by_index = {n["node"]: n for n in nodes}
        last = sum(n["kind"] == "embedding" for n in nodes) - 1
        layers = config_doc["num_hidden_layers"]
        ids = [n["node_id"] for n in doc["nodes"]]
        assert len(set(ids)) == len(ids) and ids == [_id_of(n) for n in doc["nodes"]]
        # the pruned graph's edges, by the peer's ids, weights exact
        want = {}
        for e in edges:
            s, t = by_index[e["source"]], by_index[e["target"]]
            want[(_our_id(s, layers, last), _our_id(t, layers, last))] = e["weight"]
        got = {(link["source"], link["target"]): link["weight"] for link in doc["links"]}
        assert got == pytest.approx(want, rel=0, abs=0) and got
        # every node touches a link, but embeddings and logits (all there)
        touched = {x for pair in got for x in pair}
        kinds = [n["feature_type"] for n in doc["nodes"]]
        assert all(
            i in touched for i, k in zip(ids, kinds, strict=True) if k not in ("embedding", "logit")
        )
        assert kinds.count("embedding") == sum(n["kind"] == "embedding" for n in nodes)
        logits = [n for n in doc["nodes"] if n["feature_type"] == "logit"]
        assert [n["is_target_logit"] for n in logits] == [True] + [False] * (len(logits) - 1)
        assert [n["token_prob"] for n in logits] == pytest.approx(
            [n["probability"] for n in nodes if n["kind"] == "logit"]
        )
        for n in doc["nodes"]:
            if n["feature_type"] == "cross layer transcoder":
                src = next(
                    m
                    for m in nodes
                    if m["kind"] == "feature" and _our_id(m, layers, last) == n["node_id"]
                )
                assert n["activation"] == pytest.approx(src["activation"])
                assert n["influence"] == pytest.approx(src["influence"])
    doc0 = json.loads((out / "prompt-0.json").read_text())
    key = f"{kept_feature['layer']}_{kept_feature['latent']}_{kept_feature['pos']}"
    labelled = [n for n in doc0["nodes"] if n["node_id"] == key]
    assert all(n["clerp"] == "a labelled latent" for n in labelled)


def _our_id(n: dict, n_layers: int, last: int) -> str:
    """The id of a node of the job's table, as the peer names it."""
    if n["kind"] == "feature":
        return f"{n['layer']}_{n['latent']}_{n['pos']}"
    if n["kind"] == "error":
        return f"{n['layer']}_-1_{n['pos']}"
    if n["kind"] == "embedding":
        return f"E_{n['token']}_{n['pos']}"
    return f"{n_layers + 1}_{n['token']}_{last}"


@pytest.fixture
def job_copy(graph_job, tmp_path):
    """The graph job's output without the nodes' ``probability`` column (as written
    before the job recorded it)."""
    copy = tmp_path / "old-graphs"
    shutil.copytree(graph_job, copy)
    for f in copy.glob("nodes/*/part-0.parquet"):
        pq.write_table(pq.read_table(f).drop(["probability"]), f)
    return copy


def test_older_outputs_have_their_probabilities_from_the_model(graph_job, job_copy, tmp_path):
    new = export_graphs(GraphExportConfig(graphs=str(graph_job), out=str(tmp_path / "a")))
    old = export_graphs(GraphExportConfig(graphs=str(job_copy), out=str(tmp_path / "b")))
    assert new["slugs"] == old["slugs"]
    for slug in new["slugs"]:
        a = json.loads((tmp_path / "a" / f"{slug}.json").read_text())
        b = json.loads((tmp_path / "b" / f"{slug}.json").read_text())
        pa_ = [n["token_prob"] for n in a["nodes"] if n["feature_type"] == "logit"]
        pb = [n["token_prob"] for n in b["nodes"] if n["feature_type"] == "logit"]
        assert pb == pytest.approx(pa_, rel=1e-5) and pa_


def test_refusals(graph_job, tmp_path):
    with pytest.raises(InvalidArgumentError, match="not a finished graph job"):
        export_graphs(GraphExportConfig(graphs=str(tmp_path), out=str(tmp_path / "x")))
    with pytest.raises(InvalidArgumentError, match="not a local model directory"):
        export_graphs(GraphExportConfig(graphs=str(graph_job), out=str(tmp_path / "x"),
                                        model=str(tmp_path)))  # fmt: skip
    with pytest.raises(InvalidArgumentError, match="slug_prefix"):
        GraphExportConfig(graphs="g", out="o", slug_prefix="a/b")


@pytest.mark.skipif(not CT_PYTHON.exists(), reason="no .venv-circuit-tracer (circuit-tracer 0.5.0)")
def test_circuit_tracers_models_read_every_file(graph_job, tmp_path):
    out = tmp_path / "json"
    export_graphs(GraphExportConfig(graphs=str(graph_job), out=str(out)))
    script = (
        "import json, sys, pathlib\n"
        "from circuit_tracer.frontend.graph_models import Model\n"
        "for f in sorted(pathlib.Path(sys.argv[1]).glob('prompt-*.json')):\n"
        "    doc = json.loads(f.read_text())\n"
        "    m = Model.model_validate(doc)\n"
        "    assert m.model_dump()['nodes'] == doc['nodes'], f\n"
        "    assert [dict(x) for x in m.links] == doc['links'], f\n"
        "    print(f.name, len(m.nodes), len(m.links))\n"
    )
    run = subprocess.run([str(CT_PYTHON), "-c", script, str(out)], capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert len(run.stdout.splitlines()) == sum(1 for p in GRAPH_PROMPTS if p)


def test_the_logit_layer_is_the_models_layers_plus_one(graph_job, tmp_path):
    export_graphs(GraphExportConfig(graphs=str(graph_job), out=str(tmp_path / "j"), n_layers=7))
    doc = json.loads((tmp_path / "j" / "prompt-0.json").read_text())
    logits = [n for n in doc["nodes"] if n["feature_type"] == "logit"]
    assert logits and all(n["layer"] == "8" and n["node_id"].startswith("8_") for n in logits)
