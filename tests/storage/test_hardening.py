"""Hostile and unlucky inputs at the storage layer: index rows escaping the dataset,
special files named as shards, duplicate shard entries, row counts disagreeing with the
manifest, a full disk, orphans of a write that never committed."""

import json
import os
import threading
from dataclasses import replace

import fsspec
import numpy as np
import pyarrow.parquet as pq
import pytest
from fsspec.implementations.local import LocalFileSystem

from pyspark_safetensors.dataset import (
    ColumnSchema,
    DatasetLocation,
    Manifest,
    ManifestError,
    ShardEntry,
    SpecialFileError,
    StorageError,
    index_rows,
    open_shard,
    shard_name,
    verify_dataset,
    write_batch_dataset,
    write_manifest,
)
from pyspark_safetensors.format import to_f16, write_shard
from pyspark_safetensors.torch import open_dataset


def make_batch_dataset(root, sizes):
    """activation [n, 8] F16 in shards of sizes[0] rows (the last one shorter)."""
    ids = np.arange(sum(sizes), dtype=np.int64)
    acts = to_f16(ids[:, None] + np.arange(8)[None, :] / 1000.0)
    write_batch_dataset(root, {"activation": acts, "sample_id": ids}, rows_per_shard=sizes[0])
    return root


def make_kv_dataset(root, n=4):
    """key k{i} -> layer0 [i+1, 4], indexed as _tensor_index.parquet."""
    root.mkdir(parents=True)
    tensors = {f"k{i}__layer0": np.full((i + 1, 4), i, np.float32) for i in range(n)}
    name = shard_name(0, 0)
    header = write_shard(root / name, tensors)
    pq.write_table(index_rows(name, header), root / "_tensor_index.parquet")
    schema = {"layer0": ColumnSchema("F32", (-1, 4), (-1, 4))}
    entry = ShardEntry(name, n, header.file_size, 0)
    manifest = Manifest((entry,), schema, mode="kv", name_col="key", kv_separator="__")
    write_manifest(root, replace(manifest, index_file="_tensor_index.parquet"))
    return root


def edit_manifest(root, change):
    path = root / "dataset_manifest.json"
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))


def finishes(fn, seconds=20.0):
    """Run ``fn`` on a thread; fail (instead of hanging the suite) if it blocks."""
    out = {}

    def run():
        try:
            fn()
        except BaseException as e:
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "the read blocked"
    return out.get("error")


def test_index_rows_must_name_listed_shards(tmp_path):
    root = make_kv_dataset(tmp_path / "kv")
    secret = tmp_path / "secret.safetensors"
    write_shard(secret, {"k0__layer0": np.full((1, 4), 99, np.float32)})
    table = pq.read_table(root / "_tensor_index.parquet")
    for name in ("../secret.safetensors", "part-99999-0000-unlisted.safetensors"):
        rows = table.to_pylist()
        rows[0]["file_name"] = name
        pq.write_table(table.from_pylist(rows, schema=table.schema), root / "_tensor_index.parquet")
        with pytest.raises(ManifestError, match="index rows name file"):
            open_dataset(root).get("k0")  # checked once, when the index is loaded
        with pytest.raises(ManifestError, match="index rows name file"):
            open_dataset(root, checksums=True)  # checked at open
    # byte ranges past the shard are refused too
    rows = table.to_pylist()
    rows[0]["end"] = 10**12
    pq.write_table(table.from_pylist(rows, schema=table.schema), root / "_tensor_index.parquet")
    with pytest.raises(ManifestError, match="outside its shard"):
        open_dataset(root).get("k0")


def test_index_checksum_is_verified(tmp_path):
    root = make_kv_dataset(tmp_path / "kv")
    edit_manifest(root, lambda d: d.update(index_crc32c="00000000"))
    assert open_dataset(root).get("k1", "layer0").shape == (2, 4)  # not checked unless asked
    with pytest.raises(ManifestError, match="crc32c mismatch"):
        open_dataset(root, checksums=True)
    with pytest.raises(ManifestError, match="crc32c mismatch"):
        verify_dataset(root, checksums=True)


@pytest.mark.python_source
@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_special_files_are_refused_before_opening(tmp_path, kind):
    root = make_batch_dataset(tmp_path / "ds", sizes=(10, 10))
    victim = sorted(root.glob("part-*"))[0]
    victim.unlink()
    if kind == "fifo":
        os.mkfifo(victim)
    else:
        victim.mkdir()
    err = finishes(lambda: open_dataset(root))
    assert isinstance(err, ManifestError) and victim.name in str(err)
    assert "regular file" in str(err)
    loc = DatasetLocation.of(root)
    err = finishes(lambda: open_shard(loc, victim.name))
    assert isinstance(err, SpecialFileError) and "not a regular file" in str(err)
    from pyspark_safetensors.spark.options import ReaderOptions
    from pyspark_safetensors.spark.reader import resolve

    err = finishes(lambda: resolve(ReaderOptions.parse({"path": str(root)})))
    assert err is not None and "not a regular file" in str(err)


def test_duplicate_shard_entries_are_refused(tmp_path):
    root = make_batch_dataset(tmp_path / "ds", sizes=(10, 10))

    def duplicate(doc):
        doc["shards"].append(doc["shards"][0])
        doc["total_samples"] += doc["shards"][0]["samples_count"]
        doc["total_bytes"] += doc["shards"][0]["bytes"]

    edit_manifest(root, duplicate)
    for read in (open_dataset, verify_dataset):
        with pytest.raises(ManifestError, match="a second time"):
            read(root)


def test_row_count_must_match_samples_count(tmp_path):
    root = make_batch_dataset(tmp_path / "ds", sizes=(16, 12))

    def lie(doc):
        doc["shards"][0]["samples_count"] = 12
        doc["total_samples"] -= 4

    edit_manifest(root, lie)
    with pytest.raises(ManifestError, match="the manifest says F16\\[12, 8\\]"):
        open_dataset(root)


class FullDisk(LocalFileSystem):
    """A local filesystem whose files live on /dev/full: every write fails with ENOSPC."""

    protocol = "fulldisk"

    def _open(self, path, mode="rb", **kwargs):
        if "w" in mode:
            return open("/dev/full", "wb")
        return super()._open(path, mode, **kwargs)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_disk_full_names_dataset_and_file(tmp_path):
    fsspec.register_implementation("fulldisk", FullDisk, clobber=True)
    loc = DatasetLocation(FullDisk(), str(tmp_path / "ds"), "fulldisk://ds")
    (tmp_path / "ds").mkdir()
    with pytest.raises(
        StorageError, match=r"writing 'dataset_manifest\.json' of dataset 'fulldisk://ds'"
    ) as e:
        loc.put_json("dataset_manifest.json", {"a": 1})
    assert e.value.errno == 28
    name = "part-00000-0000-00000000-0000-0000-0000-000000000000.safetensors"
    with pytest.raises(StorageError, match=f"writing '{name}' of dataset 'fulldisk://ds'.*space"):
        loc.write_shard(name, lambda p: write_shard(p, {"x": np.zeros(1000, np.float32)}))


@pytest.mark.python_source
def test_directory_of_an_uncommitted_write_is_not_served(tmp_path):
    from pyspark_safetensors.spark.options import ReaderOptions
    from pyspark_safetensors.spark.reader import ReadError, resolve

    root = make_batch_dataset(tmp_path / "ds", sizes=(10,))
    (root / "dataset_manifest.json").unlink()
    with pytest.raises(ReadError, match="never committed"):
        resolve(ReaderOptions.parse({"path": str(root)}))
    # a glob reads the files anyway, as the message says
    src = resolve(ReaderOptions.parse({"path": f"{root}/*.safetensors"}))
    assert len(src.files) == 1 and src.manifest is None


def test_a_manifest_nested_past_the_stack_is_a_manifest_error(tmp_path):
    root = make_batch_dataset(tmp_path / "ds", sizes=(10,))
    (root / "dataset_manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    for read in (open_dataset, verify_dataset):
        with pytest.raises(ManifestError, match="nested too deeply"):
            read(root)
