"""Which files a dataset directory holds after each commit: ``_tensor_index.parquet`` (the
format spec's name) describes exactly the committed generation, and an overwrite leaves
only the new dataset unless ``keep_previous_generation`` keeps the old one for its readers."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

pytest.importorskip("pyspark.sql.datasource", reason="this Spark has no Python data sources")

from direct_writes import batch, files, writer
from pyspark.sql import functions as F

from pyspark_safetensors.dataset import (
    DatasetBuilder,
    DatasetLocation,
    kv_tensor_name,
    verify_dataset,
)
from pyspark_safetensors.dataset.commit import commit_dataset
from pyspark_safetensors.torch import open_dataset

SPEC_INDEX = "_tensor_index.parquet"
SPEC_INDEX_PART = f"{SPEC_INDEX}/part-00000.parquet"
SPEC_COLUMNS = ["tensor_key", "file_name", "shape", "dtype"]


def write(path, start, n, overwrite=False, **options):
    w = writer(path, overwrite, **options)
    w.commit([w.write(iter([batch(start, n)]))])


def manifest(root):
    return json.loads((root / "dataset_manifest.json").read_text())


def named_by(m):
    """The files a manifest names, plus the two the commit always leaves."""
    names = {s["shard_path"] for s in m["shards"]} | {"dataset_manifest.json", "_SUCCESS"}
    if "index_file" in m:
        names |= {m["index_file"], SPEC_INDEX_PART}
    return sorted(names)


def check_spec_index(root):
    """``_tensor_index.parquet/`` holds the manifest's index byte for byte as its one part,
    readable by plain pyarrow with the spec's columns, covering every shard and routing
    each tensor."""
    m = manifest(root)
    assert [p.name for p in (root / SPEC_INDEX).iterdir()] == ["part-00000.parquet"]
    assert (root / SPEC_INDEX_PART).read_bytes() == (root / m["index_file"]).read_bytes()
    table = pq.read_table(root / SPEC_INDEX)
    assert table.column_names[:4] == SPEC_COLUMNS
    assert set(table.column("file_name").to_pylist()) == {s["shard_path"] for s in m["shards"]}
    return table


def test_batch_index_under_the_spec_name_routes_every_tensor(tmp_path):
    root = tmp_path / "ds"
    write(root, 0, 10, overwrite=True, generate_index="true")
    table = check_spec_index(root)
    for row in table.to_pylist():
        raw = (root / row["file_name"]).read_bytes()[row["begin"] : row["end"]]
        assert len(raw) == np.prod(row["shape"]) * {"F32": 4, "I64": 8}[row["dtype"]]
        if row["tensor_key"] == "id":
            ids = np.frombuffer(raw, np.int64)
            assert ids[0] % 4 == 0 and list(ids) == list(range(ids[0], ids[0] + len(ids)))


def test_kv_index_routes_a_key_to_its_bytes(tmp_path):
    root = tmp_path / "kv"
    write(root, 0, 7, overwrite=True, name_col="key")
    table = check_spec_index(root)
    [row] = [r for r in table.to_pylist() if r["tensor_key"] == "k5__vec"]
    raw = (root / row["file_name"]).read_bytes()[row["begin"] : row["end"]]
    assert np.frombuffer(raw, np.float32).tolist() == [5.0, 5.5]
    assert row["shape"] == [2] and row["dtype"] == "F32"


def test_append_index_covers_every_shard(tmp_path):
    root = tmp_path / "ds"
    write(root, 0, 8, overwrite=True, generate_index="true")
    first = manifest(root)
    write(root, 8, 8, generate_index="true")
    m = manifest(root)
    table = check_spec_index(root)
    assert len(m["shards"]) == 2 * len(first["shards"])
    ids = table.filter(pa.compute.equal(table.column("tensor_key"), "id"))
    assert ids.num_rows == len(m["shards"])
    assert files(root) == named_by(m)  # the first commit's index went with it


def test_append_without_index_deletes_the_stale_one(tmp_path):
    root = tmp_path / "ds"
    write(root, 0, 8, overwrite=True, generate_index="true")
    write(root, 8, 4)
    m = manifest(root)
    assert "index_file" not in m and not (root / SPEC_INDEX).exists()
    assert files(root) == named_by(m)


@pytest.mark.parametrize("index", ["true", "false"])
def test_overwrite_leaves_only_the_new_dataset(tmp_path, index):
    root = tmp_path / "ds"
    write(root, 0, 12, overwrite=True, generate_index="true")
    old = manifest(root)
    write(root, 100, 5, overwrite=True, generate_index=index)
    m = manifest(root)
    assert files(root) == named_by(m)
    assert not {s["shard_path"] for s in old["shards"]} & set(files(root))
    assert old["index_file"] not in files(root)
    if index == "true":
        table = check_spec_index(root)
        assert set(table.column("file_name").to_pylist()).isdisjoint(
            s["shard_path"] for s in old["shards"]
        )
    else:
        assert not (root / SPEC_INDEX).exists()
    ds = open_dataset(root, checksums=True)
    assert sorted(ds[i]["id"].item() for i in range(len(ds))) == list(range(100, 105))


def test_write_batch_dataset_overwrites_only_when_asked(tmp_path):
    from pyspark_safetensors.dataset import write_batch_dataset

    root = tmp_path / "arrays"
    write_batch_dataset(root, {"id": np.arange(12)}, rows_per_shard=4)
    old = manifest(root)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        write_batch_dataset(root, {"id": np.arange(3)})
    write_batch_dataset(root, {"id": np.arange(100, 105)}, rows_per_shard=4, overwrite=True)
    assert files(root) == named_by(manifest(root))
    assert not {s["shard_path"] for s in old["shards"]} & set(files(root))
    ds = open_dataset(root, checksums=True)
    assert sorted(ds[i]["id"].item() for i in range(len(ds))) == list(range(100, 105))


def test_keep_previous_generation_lets_an_open_reader_finish(tmp_path):
    root = tmp_path / "ds"
    write(root, 0, 12, overwrite=True, generate_index="true")
    old = manifest(root)
    reader = open_dataset(root)
    w = writer(root, overwrite=True, generate_index="true")
    commit_dataset(
        w.job.location,
        w.job.job_id,
        [w.write(iter([batch(100, 5)])).result],
        w.job.template(),
        overwrite=True,
        generate_index=True,
        unique_keys=False,
        keep_previous_generation=True,
    )
    kept = {s["shard_path"] for s in old["shards"]} | {old["index_file"]}
    assert set(files(root)) == set(named_by(manifest(root))) | kept
    assert sorted(reader[i]["id"].item() for i in range(len(reader))) == list(range(12))
    check_spec_index(root)  # the spec's name already describes the new generation
    write(root, 200, 3, overwrite=True, generate_index="true")  # the next commit reclaims it
    assert files(root) == named_by(manifest(root))


# ------------------------------------------------------------------ through Spark


def frame(spark, n, parts=2):
    return spark.range(n, numPartitions=parts).select(
        F.col("id"),
        F.array(*[(F.col("id") * 10 + j).cast("float") for j in range(3)]).alias("vec"),
        F.concat(F.lit("doc"), F.col("id").cast("string")).alias("key"),
    )


def save(df, path, mode="overwrite", **options):
    w = df.write.format("safetensors").mode(mode)
    for k, v in options.items():
        w = w.option(k, v)
    w.save(str(path))


@pytest.mark.spark
def test_spark_batch_and_kv_writes_leave_the_spec_index(spark, tmp_path):
    save(frame(spark, 10).select("id", "vec"), tmp_path / "b", batch_size=4, generate_index="true")
    save(
        frame(spark, 10, parts=1).select("id", "vec"),
        tmp_path / "b",
        "append",
        batch_size=4,
        generate_index="true",
    )
    table = check_spec_index(tmp_path / "b")
    ids = table.filter(pa.compute.equal(table.column("tensor_key"), "id"))
    assert ids.num_rows == len(manifest(tmp_path / "b")["shards"]) == 2 * 2 + 3
    save(frame(spark, 6), tmp_path / "kv", name_col="key", generate_index="true")
    table = check_spec_index(tmp_path / "kv")
    row = table.filter(pa.compute.equal(table.column("tensor_key"), "doc4__vec")).to_pylist()[0]
    raw = (tmp_path / "kv" / row["file_name"]).read_bytes()[row["begin"] : row["end"]]
    assert np.frombuffer(raw, np.float32).tolist() == [40.0, 41.0, 42.0]


@pytest.mark.spark
def test_spark_keep_previous_generation_lets_a_torch_reader_finish(spark, tmp_path):
    out = tmp_path / "ds"
    save(frame(spark, 12, parts=3).select("id", "vec"), out, batch_size=2)
    kept, dropped = open_dataset(out), open_dataset(out)
    save(frame(spark, 4, parts=1).select("id", "vec"), out, batch_size=2,
         keep_previous_generation="true")  # fmt: skip
    assert sorted(kept[i]["id"].item() for i in range(len(kept))) == list(range(12))
    assert sorted(r.id for r in spark.read.format("safetensors").load(str(out)).collect()) == [
        0, 1, 2, 3
    ]  # fmt: skip
    save(frame(spark, 4, parts=1).select("id", "vec"), out, batch_size=2)
    assert files(out) == named_by(manifest(out))
    with pytest.raises(Exception, match="was replaced or deleted after it was opened"):
        [dropped[i] for i in range(len(dropped))]


@pytest.mark.spark
def test_spark_overwrite_on_s3_leaves_only_the_new_dataset(spark, s3_bucket, s3_endpoint):
    uri = f"{s3_bucket}/gen"
    opts = {"endpoint_url": s3_endpoint, "batch_size": 4, "generate_index": "true"}
    save(frame(spark, 20, parts=3).select("id", "vec"), uri, **opts)
    save(frame(spark, 5, parts=1).select("id", "vec"), uri, **opts)
    loc = DatasetLocation.of(uri, storage_options={"endpoint_url": s3_endpoint})
    listed = sorted(n for n, i in loc.list(recursive=True).items() if i.type == pafs.FileType.File)
    m = json.loads(loc.read_bytes("dataset_manifest.json"))
    assert listed == named_by(m)
    assert loc.read_bytes(SPEC_INDEX_PART) == loc.read_bytes(m["index_file"])
    table = pq.read_table(f"{loc.root}/{SPEC_INDEX}", filesystem=loc.fs)
    assert table.column_names[:4] == SPEC_COLUMNS
    assert set(table.column("file_name").to_pylist()) == {s["shard_path"] for s in m["shards"]}


# ------------------------------------------------------------------ DatasetBuilder


def build_kv(root, n=6, **options):
    with DatasetBuilder(root, mode="kv", name_col="key", **options) as build:
        for part in range(2):
            build.add_kv(
                {
                    f"s{i}": {"layer0": np.full((i + 1, 3), i, np.float32), "id": np.int64(i)}
                    for i in range(part * n // 2, (part + 1) * n // 2)
                }
            )
    return build.manifest


def test_builder_batch_dataset_commits_like_a_spark_write(tmp_path):
    root = tmp_path / "b"
    x = np.arange(40, dtype=np.float32).reshape(10, 4)
    with DatasetBuilder(root, batch_size=4, generate_index=True, metadata={"m": "1"}) as build:
        for start in range(0, 10, 4):
            build.add_batch(
                {"x": x[start : start + 4], "row": np.arange(start, min(start + 4, 10))}
            )
    m = verify_dataset(root, checksums=True)
    assert m == build.manifest and m.total_samples == 10 and m.metadata == {"m": "1"}
    assert m.schema["x"].shape == (4, 4) and [s.first_sample for s in m.shards] == [0, 4, 8]
    check_spec_index(root)
    assert files(root) == named_by(manifest(root))
    ds = open_dataset(root, checksums=True)
    assert np.array_equal(np.stack([ds[i]["x"].numpy() for i in range(10)]), x)


def test_builder_kv_dataset_names_tensors_by_the_layout_rule(tmp_path):
    m = build_kv(tmp_path / "kv")
    assert verify_dataset(tmp_path / "kv", checksums=True) == m
    assert m.schema["layer0"].sample_shape == (-1, 3) and m.schema["id"].sample_shape == ()
    table = check_spec_index(tmp_path / "kv")
    assert set(table.column("tensor_key").to_pylist()) == {
        kv_tensor_name(f"s{i}", c, "__") for i in range(6) for c in ("layer0", "id")
    }
    ds = open_dataset(tmp_path / "kv")
    assert ds.get("s4", "layer0").tolist() == [[4.0] * 3] * 5


def test_builder_refuses_a_repeated_key_and_leaves_the_dataset_as_it_was(tmp_path):
    root = tmp_path / "kv"
    build_kv(root, overwrite=True)
    before = files(root)
    with pytest.raises(ValueError, match="duplicate tensor keys"):
        build_kv(root)  # an append of the same keys
    assert files(root) == before
    with (
        pytest.raises(RuntimeError, match="stops"),
        DatasetBuilder(tmp_path / "new", batch_size=2) as build,
    ):
        build.add_batch({"x": np.zeros((2, 3), np.float32)})
        raise RuntimeError("the producer stops")
    assert not (tmp_path / "new").exists()


@pytest.mark.spark
def test_builder_datasets_are_read_by_spark(spark, tmp_path):
    build_kv(tmp_path / "kv")
    rows = spark.read.format("safetensors").load(str(tmp_path / "kv")).collect()
    assert sorted(r.key for r in rows) == [f"s{i}" for i in range(6)]
    ids = {r.key: r.id for r in rows}
    assert ids == {f"s{i}": i for i in range(6)}
    with DatasetBuilder(tmp_path / "b", batch_size=3) as build:
        build.add_batch({"v": np.arange(6, dtype=np.float32).reshape(3, 2)})
        build.add_batch({"v": np.arange(6, 8, dtype=np.float32).reshape(1, 2)})
    df = spark.read.format("safetensors").load(str(tmp_path / "b"))
    assert sorted(r.v for r in df.collect()) == [[0, 1], [2, 3], [4, 5], [6, 7]]
