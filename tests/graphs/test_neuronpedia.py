"""Feature browsers as the field's feature viewers read them: the feature JSON of every
feature node of the exported graphs (valid against Neuronpedia's published schema, read
back by circuit-tracer's own pydantic model where ``.venv-circuit-tracer`` is, its values
the browser's statistics and examples, its logits a dense computation's), and Neuronpedia's
export of a browser (every row a valid row of the Prisma model its importer inserts it
into, the values the browser's). Vendored peer files: ``data/README.md``."""

from __future__ import annotations

import gzip
import itertools
import json
import re
import subprocess
from collections import defaultdict
from pathlib import Path

import jsonschema
import numpy as np
import pyarrow.parquet as pq
import pytest

from pyspark_safetensors.extract.toy_lm import TINY
from pyspark_safetensors.features.config import FeaturesError
from pyspark_safetensors.features.neuronpedia import (
    NeuronpediaConfig,
    band_ranges,
    export_neuronpedia,
    linear_histogram,
    quantile_values,
)
from pyspark_safetensors.features.state import histogram_edges
from pyspark_safetensors.graphs.export import GraphExportConfig, cantor, export_graphs

pytestmark = pytest.mark.spark

DATA = Path(__file__).parent / "data"
ROOT = Path(__file__).resolve().parents[2]
CT_PYTHON = ROOT / ".venv-circuit-tracer" / "bin" / "python"


@pytest.fixture(scope="module")
def browsers(toy, dictionaries, tmp_path_factory):
    """The feature job on each layer of the graphs' random CLT (a small extraction of both
    blocks' MLP inputs): ``layer{l}`` under the returned directory."""
    from pyspark_safetensors.extract import ExtractConfig, run_extraction
    from pyspark_safetensors.features import FeaturesConfig, run_features
    from spark_sessions import spark_session

    spark = spark_session("local")
    root = tmp_path_factory.mktemp("np-features")
    hooks = tuple(f"model.layers.{i}.mlp:input" for i in range(TINY.num_layers))
    run_extraction(spark, ExtractConfig(model=str(toy), hooks=hooks, max_length=0, max_texts=4,
                                        dtype="F32", rows_per_shard=256, kv_dataset=False),
                   root / "acts")  # fmt: skip
    for layer in range(TINY.num_layers):
        run_features(spark, FeaturesConfig(extraction=str(root / "acts"), out=str(root / f"layer{layer}"),
                                           sae=str(dictionaries["clt"]), clt_layer=layer, top_n=3))  # fmt: skip
    return root


def _tables(browser: Path):
    latents = pq.read_table(browser / "latents.parquet").sort_by("latent").to_pylist()
    contexts = pq.read_table(browser / "contexts.parquet").to_pylist()
    return latents, contexts


def _dense_top_logits(toy, clt_file, layer: int, latent: int, k: int = 10):
    """The top and bottom ``k`` tokens of a latent's summed decoder rows times the final
    RMSNorm's weight times the unembedding, computed directly."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(toy, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(toy, local_files_only=True)
    direction = load_file(clt_file)[f"decoder_weight.{layer}"][latent].float().sum(0)
    logits = (direction * model.model.norm.weight.float()) @ model.lm_head.weight.float().T
    order = torch.argsort(logits, descending=True).tolist()
    return [tok.decode([t]) for t in order[:k]], [tok.decode([t]) for t in order[::-1][:k]]


def test_every_feature_node_has_its_feature_json(graph_job, browsers, toy, dictionaries, tmp_path):
    out = tmp_path / "graph-json"
    summary = export_graphs(GraphExportConfig(graphs=str(graph_job), out=str(out), scan="toy-llama",
                                              features=(str(browsers / "layer{layer}"),)))  # fmt: skip
    schema = json.loads((DATA / "neuronpedia-feature-details-schema.json").read_text())
    validator = jsonschema.Draft7Validator(schema)
    indices = set()
    for slug in summary["slugs"]:
        graph = json.loads((out / f"{slug}.json").read_text())
        indices |= {n["feature"] for n in graph["nodes"]
                    if n["feature_type"] == "cross layer transcoder"}  # fmt: skip
    assert indices and summary["features"] == len(indices) and summary["features_missing"] == []
    assert {int(p.stem) for p in (out / "features").glob("*.json")} == indices
    tables = {layer: _tables(browsers / f"layer{layer}") for layer in range(TINY.num_layers)}
    checked_logits = 0
    for layer in range(TINY.num_layers):
        for latent in range(len(tables[layer][0])):
            index = cantor(layer, latent)
            if index not in indices:
                continue
            doc = json.loads((out / "features" / f"{index}.json").read_text())
            validator.validate(doc)
            row = tables[layer][0][latent]
            assert doc["index"] == index and doc["transcoder_id"] == dictionaries["clt"].name
            assert doc["act_min"] == 0 and doc["act_max"] == pytest.approx(row["max"])
            assert doc["activation_frequency"] == pytest.approx(row["frequency"])
            assert sum(doc["histogram"]) == pytest.approx(row["count"])
            assert len(doc["quantile_values"]) == 100
            assert doc["quantile_values"] == sorted(doc["quantile_values"])
            assert doc["quantile_values"][-1] == pytest.approx(row["max"])
            top = sorted((c for c in tables[layer][1] if c["latent"] == latent and c["kind"] == "top"),
                         key=lambda c: c["rank"])  # fmt: skip
            first = doc["examples_quantiles"][0]
            assert first["quantile_name"] == "Top activations"
            assert [(e["tokens"], e["train_token_ind"]) for e in first["examples"]] == [
                (c["tokens"], c["center"]) for c in top
            ]
            assert [e["tokens_acts_list"] for e in first["examples"]] == [
                pytest.approx(c["acts"]) for c in top
            ]
            for e, c in zip(first["examples"], top, strict=True):  # the example token's value
                assert e["tokens_acts_list"][e["train_token_ind"]] == pytest.approx(c["value"])
            bands = [q["quantile_name"] for q in doc["examples_quantiles"][1:]]
            assert all(re.fullmatch(r"Quantile \d+-\d+%", b) for b in bands)
            if checked_logits < 3:  # a few against the dense computation (a model load each)
                assert (doc["top_logits"], doc["bottom_logits"]) == _dense_top_logits(
                    toy, dictionaries["clt"], layer, latent
                )
                checked_logits += 1
    assert checked_logits == 3


def test_a_layer_without_a_browser_is_named(graph_job, browsers, tmp_path):
    summary = export_graphs(GraphExportConfig(graphs=str(graph_job), out=str(tmp_path / "g"),
                                              features=(str(browsers / "layer0"), ""),
                                              feature_logits=False))  # fmt: skip
    assert summary["features_missing"] == [1] and summary["features"] > 0
    docs = [json.loads(p.read_text()) for p in (tmp_path / "g" / "features").glob("*.json")]
    assert docs and all(d["top_logits"] == [] for d in docs)
    with pytest.raises(ValueError, match="layer 1's browser, given for layer 0"):
        export_graphs(GraphExportConfig(graphs=str(graph_job), out=str(tmp_path / "h"),
                                        features=(str(browsers / "layer1"),), feature_logits=False))  # fmt: skip


@pytest.mark.skipif(not CT_PYTHON.exists(), reason="no .venv-circuit-tracer (circuit-tracer 0.5.0)")
def test_circuit_tracers_feature_model_reads_every_file(graph_job, browsers, tmp_path):
    out = tmp_path / "graph-json"
    export_graphs(GraphExportConfig(graphs=str(graph_job), out=str(out), feature_logits=False,
                                    features=(str(browsers / "layer{layer}"),)))  # fmt: skip
    script = (
        "import json, sys, pathlib\n"
        "from circuit_tracer.frontend.feature_models import Model\n"
        "for p in sorted(pathlib.Path(sys.argv[1]).glob('*.json')):\n"
        "    doc = json.loads(p.read_text())\n"
        "    assert Model.model_validate(doc).model_dump() == doc, p\n"
        "print('ok')\n"
    )
    run = subprocess.run([str(CT_PYTHON), "-c", script, str(out / "features")],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr


# ---- Neuronpedia's export against its Prisma models --------------------------------------

_SCALARS = {"String": str, "Int": int, "Float": (int, float), "Boolean": bool,
            "DateTime": str, "Json": object, "Visibility": str}  # fmt: skip


def prisma_models() -> dict[str, dict[str, dict]]:
    """``{model: {column: {"type", "list", "optional", "default"}}}`` of the vendored
    models (relation fields, whose type is a model, are not columns)."""
    text = (DATA / "neuronpedia-export-models.prisma").read_text()
    models = {}
    for name, body in re.findall(r"^model (\w+) \{\n(.*?)^\}", text, re.S | re.M):
        columns = {}
        for line in body.splitlines():
            parts = line.split("//")[0].split()
            if len(parts) < 2 or parts[0].startswith("@@"):
                continue
            m = re.fullmatch(r"(\w+)(\(.*\))?(\[\])?(\?)?", parts[1])
            base = m.group(1)
            if base not in _SCALARS and base != "Unsupported":
                continue  # a relation
            attrs = " ".join(parts[2:])
            columns[parts[0]] = {"type": _SCALARS.get(base, object), "list": bool(m.group(3)),
                                 "optional": bool(m.group(4)),
                                 "default": "@default" in attrs or "@updatedAt" in attrs}  # fmt: skip
        models[name] = columns
    return models


def conformance_errors(row: dict, columns: dict[str, dict]) -> list[str]:
    """Why ``row`` is not a row of the table: an unknown key, a value of the wrong type,
    a required column missing."""
    errors = [f"{k}: no such column" for k in row if k not in columns]
    for name, c in columns.items():
        if name not in row:
            if not (c["optional"] or c["default"] or c["list"]):
                errors.append(f"{name}: required")
            continue
        value = row[name]
        if value is None:
            if not c["optional"]:
                errors.append(f"{name}: null")
        elif c["list"]:
            if not isinstance(value, list) or not all(
                (isinstance(v, c["type"]) and not isinstance(v, bool)) or c["type"] is bool
                for v in value
            ):
                errors.append(f"{name}: {value!r} is not a list of {c['type']}")
        elif not isinstance(value, c["type"]) or (
            c["type"] is not bool and isinstance(value, bool)
        ):
            errors.append(f"{name}: {value!r} is not {c['type']}")
    return errors


def test_the_vendored_models_are_read_and_refuse_a_bad_row():
    models = prisma_models()
    assert set(models) == {"Model", "SourceRelease", "SourceSet", "Source", "Neuron",
                           "Activation", "Explanation"}  # fmt: skip
    assert models["Activation"]["values"] == {"type": (int, float), "list": True,
                                              "optional": False, "default": False}  # fmt: skip
    assert "neuron" not in models["Activation"]  # a relation
    bad = {"id": "x", "tokens": ["a"], "index": 3, "layer": "0-x", "modelId": "m", "oops": 1}
    assert sorted(conformance_errors(bad, models["Activation"])) == [
        "creatorId: required", "index: 3 is not <class 'str'>", "maxValue: required",
        "maxValueTokenIndex: required", "minValue: required", "oops: no such column",
    ]  # fmt: skip


def _jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def test_neuronpedia_export_of_a_browser(browsers, toy, tmp_path):
    labels = tmp_path / "labels.jsonl"
    labels.write_text("".join(json.dumps({"layer": layer, "latent": latent, "label": f"L{layer}/{latent}"}) + "\n"
                              for layer, latent in ((1, 3), (1, 20), (0, 5))))  # fmt: skip
    out = tmp_path / "np"
    summary = export_neuronpedia(NeuronpediaConfig(features=str(browsers / "layer1"), out=str(out),
                                                   model_id="toy-llama", source_set="clt-48",
                                                   labels=str(labels), batch_size=20))  # fmt: skip
    source = out / "toy-llama" / "1-clt-48"
    assert summary["source"] == "1-clt-48" and summary["explanations"] == 2
    latents, contexts = _tables(browsers / "layer1")
    models = prisma_models()
    tables = {"features": "Neuron", "activations": "Activation", "explanations": "Explanation"}
    rows = {}
    for part, table in tables.items():
        files = sorted(source.glob(f"{part}/batch-*.jsonl.gz"))
        assert [f.name for f in files] == [f"batch-{i}.jsonl.gz" for i in range(len(files))]
        rows[part] = []
        for f in files:
            batch = _jsonl(f)
            assert len({tuple(r) for r in batch}) == 1  # the importer's columns: the first row's
            assert all(int(r["index"]) // 20 == int(f.name[6:].split(".")[0]) for r in batch)
            for r in batch:
                assert conformance_errors(r, models[table]) == [], (part, r)
            rows[part] += batch
    for name, table in (("model", "Model"), ("release", "SourceRelease"),
                        ("sourceset", "SourceSet"), ("source", "Source")):  # fmt: skip
        (row,) = _jsonl(source / f"{name}.jsonl")
        assert conformance_errors(row, models[table]) == [], (name, row)
    assert [int(r["index"]) for r in rows["features"]] == list(range(len(latents)))
    for r, latent in zip(rows["features"], latents, strict=True):
        assert (r["modelId"], r["layer"], r["sourceSetName"]) == ("toy-llama", "1-clt-48", "clt-48")
        assert r["maxActApprox"] == pytest.approx(latent["max"])
        assert r["frac_nonzero"] == pytest.approx(latent["frequency"])
        assert sum(r["freq_hist_data_bar_heights"]) == pytest.approx(latent["count"], abs=0.05)
        assert len(r["pos_str"]) == len(r["pos_values"]) == 10 == len(r["neg_str"])
        assert r["pos_values"] == sorted(r["pos_values"], reverse=True)
        assert sum(r["logits_hist_data_bar_heights"]) == TINY.vocab_size
    shown = [c for c in contexts if c["tokens"]]
    assert len(rows["activations"]) == len(shown)
    assert len({r["id"] for r in rows["activations"]}) == len(shown)

    def key(r):
        return (int(r.get("index", r.get("latent"))), tuple(r["tokens"]),
                r.get("qualifyingTokenIndex", r.get("center")))  # fmt: skip

    wanted, got = defaultdict(list), defaultdict(list)
    for c in shown:
        wanted[key(c)].append(c)
    for r in rows["activations"]:
        got[key(r)].append(r)
    assert wanted.keys() == got.keys()
    for k, cs in wanted.items():  # a window may be a top example and a random one too
        rs = got[k]
        assert len(rs) == len(cs)
        for r in rs:
            assert (
                r["values"] == pytest.approx(cs[0]["acts"])
                and r["values"][r["maxValueTokenIndex"]] == r["maxValue"]
            )
        tops = [r for r in rs if r["binMin"] == -1]
        assert len(tops) == sum(c["kind"] == "top" for c in cs)
        for r in tops:
            assert r["binContains"] == -1 and r["binMax"] == pytest.approx(latents[k[0]]["max"])
        for c in (c for c in cs if c["kind"] != "top"):  # in its band's range
            assert any(r["binMin"] <= c["value"] * (1 + 1e-6) and c["value"] <= r["binMax"] * (1 + 1e-6)
                       and 0 < r["binContains"] <= 1 for r in rs if r["binMin"] != -1)  # fmt: skip
    assert {(r["index"], r["description"]) for r in rows["explanations"]} == {
        ("3", "L1/3"),
        ("20", "L1/20"),
    }


def test_the_histogram_s_statistics_against_the_values():
    rng = np.random.default_rng(0)
    values = rng.lognormal(0.0, 1.0, 20_000)
    edges = histogram_edges(40, 1e-3, 1e3)
    counts = np.bincount(np.searchsorted(edges[1:-1], values, side="right"), minlength=40)
    vmax = float(values.max())
    levels = [(i + 1) / 100 for i in range(100)]
    exact = np.quantile(values, levels)
    got = np.asarray(quantile_values(counts, edges, vmax, levels))
    step = (1e3 / 1e-3) ** (1 / 40)  # one bin's ratio: the approximation's bound
    assert np.all(got <= exact * step) and np.all(got >= exact / step)
    assert got[-1] == pytest.approx(vmax)
    hist = linear_histogram(counts, edges, vmax, 20)
    dense = np.histogram(values, bins=20, range=(0, vmax))[0]
    assert hist.sum() == pytest.approx(len(values))
    assert np.abs(hist - dense).sum() / len(values) < 0.05
    ranges = band_ranges(counts, edges, vmax, (0.0, 0.25, 0.5, 0.75))
    assert list(ranges) == ["q0.00-0.25", "q0.25-0.50", "q0.50-0.75"]
    bounds = list(ranges.values())
    for lo, hi, share in bounds:  # a band: whole bins, its share the values in them
        assert share == pytest.approx(np.mean((values >= lo) & (values < hi)), abs=1e-9)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))


def test_neuronpedia_config_refuses_bad_names():
    with pytest.raises(FeaturesError, match="source_set"):
        NeuronpediaConfig(features="f", out="o", source_set="a/b")
    with pytest.raises(FeaturesError, match="batch_size"):
        NeuronpediaConfig(features="f", out="o", batch_size=0)
