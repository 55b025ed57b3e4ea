"""Zarr activation stores: stores and runs written by zarr-python directly (per the
layout, not by our writer) read back exactly, reads touch only their chunks, conversions
round-trip, bad input fails clearly."""

from __future__ import annotations

import json
import os
import warnings
from typing import ClassVar

import numpy as np
import pytest

zarr = pytest.importorskip("zarr")

from pyspark_safetensors.cli import main as cli  # noqa: E402
from pyspark_safetensors.interop import ConversionError, convert, detect_source  # noqa: E402
from pyspark_safetensors.interop.zarr import (  # noqa: E402
    ActivationRun,
    ActivationStore,
    PerformanceWarning,
    StoreWriter,
    ZarrStoreError,
    merge_run,
    open_activations,
    token_chunk,
    verify_store,
    write_run_manifest,
)

# zarr notes the plain text/ folder when it walks a store's hierarchy
pytestmark = pytest.mark.filterwarnings("ignore:Object at text is not recognized")
L, H, T_MAX, T_CHUNK = 3, 8, 12, 5
PROMPTS = ["Grüße, 世界", "naïve café", "ok", "emoji 🙂", "x", "ÅÄÖ", "ß", "末"]


def _samples(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    lengths = [0, T_MAX, *rng.integers(1, T_MAX + 1, n - 2).tolist()][:n]
    acts = [rng.standard_normal((L, t, H)).astype(np.float16) for t in lengths]
    return acts, lengths


def _array(group, name, values, **kw):
    a = group.create_array(
        name, shape=values.shape, chunks=values.shape or (1,), dtype=values.dtype,
        compressors=None, filters=None, **kw,
    )  # fmt: skip
    a[:] = values
    return a


def write_seed_store(path, acts, lengths, *, keys=None, chunks=(1, 1, T_CHUNK, H), **kw):
    """A store exactly as the layout describes it, written with zarr-python only."""
    n = len(acts)
    root = zarr.open_group(str(path), mode="w", zarr_format=2)
    a = root.create_array(
        "arrays/activations", shape=(n, L, T_MAX, H), chunks=chunks, dtype="float16",
        compressors=kw.pop("compressors", None), filters=None, fill_value=0, order="C",
    )  # fmt: skip
    for i, x in enumerate(acts):
        a[i, :, : x.shape[1], :] = x
    _array(root, "arrays/seq_len", np.array(lengths, np.int32))
    _array(root, "arrays/prompt_len", np.arange(n, dtype=np.int32))
    _array(root, "arrays/response_len", np.arange(n, dtype=np.int32) * 2)
    _array(root, "arrays/hallu_label", np.arange(n, dtype=np.int8) % 2)
    _array(root, "arrays/split", np.arange(n, dtype=np.int8) % 3)
    keys = keys or [f"{i:064x}" for i in range(n)]
    _array(root, "arrays/sample_key", np.array([k.encode() for k in keys], "S64"))
    root.attrs.update({
        "schema_version": "1.0", "model_id": "tiny/model", "num_layers": L,
        "hidden_size": H, "T_max": T_MAX, "dtype": "float16", "T_chunk": chunks[2],
        "created_at": "2026-01-22T00:00:00Z", "dataset": "unit",
    })  # fmt: skip
    zarr.consolidate_metadata(str(path))
    (path / "text").mkdir()
    with open(path / "text" / "prompts.jsonl", "w", encoding="utf-8") as f:
        for i in range(n):
            rec = {"i": i, "sample_key": keys[i], "prompt": PROMPTS[i % len(PROMPTS)]}
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    with open(path / "text" / "extra_metadata.jsonl", "w", encoding="utf-8") as f:
        for i in range(n):
            f.write(json.dumps({"i": i, "sample_key": keys[i], "judge": "sí"}) + "\n")
    return path


@pytest.fixture
def seed_store(tmp_path):
    acts, lengths = _samples(6)
    return write_seed_store(tmp_path / "activations.zarr", acts, lengths), acts


def write_seed_run(run_dir, acts, lengths, shards=2):
    """Round-robin placement: global sample g lives in shard g % shards, so the
    concatenation of the shards is *not* the global order."""
    placement = []
    for s in range(shards):
        mine = list(range(s, len(acts), shards))
        write_seed_store(
            run_dir / "shards" / f"shard-{s:04d}.zarr",
            [acts[g] for g in mine], [lengths[g] for g in mine],
            keys=[f"key-{g}" for g in mine],
        )  # fmt: skip
    for g in range(len(acts)):
        placement.append({"global_index": g, "shard_path": f"shards/shard-{g % shards:04d}.zarr",
                          "local_index": g // shards})  # fmt: skip
    doc = {
        "schema_version": "1.0", "model_id": "tiny/model", "num_layers": L, "hidden_size": H,
        "T_max": T_MAX, "dtype": "float16", "created_at": "2026-01-22T00:00:00Z",
        "num_shards": shards, "total_samples": len(acts),
        "shards": [{"shard_id": s, "path": f"shards/shard-{s:04d}.zarr",
                    "num_samples": len(range(s, len(acts), shards))} for s in range(shards)],
        "samples": placement[::-1],  # order of the list does not matter, global_index does
    }  # fmt: skip
    (run_dir / "manifest.json").write_text(json.dumps(doc))
    return run_dir


def test_read_returns_each_logged_slice_on_both_paths(seed_store):
    path, acts = seed_store
    fast, plain = ActivationStore(path), ActivationStore(path, fast=False)
    assert fast.fast and not plain.fast
    for i, x in enumerate(acts):
        for layer in range(L):
            got = fast.read(i, layer)
            assert got.dtype == np.float16 and got.shape == (x.shape[1], H)
            np.testing.assert_array_equal(got, x[layer])
            np.testing.assert_array_equal(plain.read(i, layer), got)
            np.testing.assert_array_equal(fast.read_zarr(i, layer), got)
    t = fast.read(3, 1, torch=True)
    assert str(t.dtype) == "torch.float16" and np.array_equal(t.numpy(), acts[3][1])
    assert fast.sample_key(2) == f"{2:064x}" and fast.arrays["hallu_label"].dtype == np.int8
    assert fast.text("prompts.jsonl")[3]["prompt"] == PROMPTS[3]
    with pytest.raises(IndexError, match="layer 3"):
        fast.read(0, 3)


class SpyStore(zarr.storage.LocalStore):
    """A LocalStore recording every key read."""

    keys: ClassVar[list[str]] = []

    async def get(self, key, prototype, byte_range=None):
        SpyStore.keys.append(key)
        return await super().get(key, prototype, byte_range)


def test_a_read_touches_only_that_layers_chunks(seed_store, monkeypatch):
    path, acts = seed_store
    i, layer = 1, 2  # seq_len = T_MAX: three token chunks
    store = ActivationStore(path, fast=False)
    group = zarr.open_group(SpyStore(str(path), read_only=True), mode="r")
    array = group["arrays/activations"]
    SpyStore.keys = []
    np.testing.assert_array_equal(array[i, layer, : acts[i].shape[1], :], store.read(i, layer))
    chunks = [k for k in SpyStore.keys if "activations" in k and k.split("/")[-1][0] != "."]
    assert sorted(chunks) == [f"arrays/activations/{i}.{layer}.{c}.0" for c in range(3)]

    opened = []
    real_open = os.open
    monkeypatch.setattr(
        os, "open", lambda p, *a, **k: opened.append(str(p)) or real_open(p, *a, **k)
    )
    fast = ActivationStore(path)
    opened.clear()
    fast.read(i, layer)
    assert [p.rsplit("/", 1)[1] for p in opened] == [f"{i}.{layer}.{c}.0" for c in range(3)]
    opened.clear()
    fast.read(4, 0)  # shorter sample: only the chunks its tokens need
    assert len(opened) == -(-acts[4].shape[1] // T_CHUNK)


def test_sharded_run_reads_in_manifest_order_and_merges(tmp_path):
    acts, lengths = _samples(7, seed=1)
    run_dir = write_seed_run(tmp_path / "run", acts, lengths, shards=3)
    assert detect_source(run_dir) == "zarr-run"
    run = open_activations(run_dir)
    assert isinstance(run, ActivationRun) and len(run) == 7
    for g, x in enumerate(acts):
        assert run.sample_key(g) == f"key-{g}"
        for layer in range(L):
            np.testing.assert_array_equal(run.read(g, layer), x[layer])
    merged = merge_run(run_dir, tmp_path / "merged.zarr", workers=2, progress=False)
    store = ActivationStore(merged)
    assert store.chunks == (1, 1, T_CHUNK, H) and store.attrs["dataset"] == "unit"
    assert (merged / ".zmetadata").is_file()
    assert [store.sample_key(g) for g in range(7)] == [f"key-{g}" for g in range(7)]
    np.testing.assert_array_equal(store.seq_len, lengths)
    np.testing.assert_array_equal(
        store.arrays["prompt_len"], [g // 3 for g in range(7)]
    )  # each shard's local prompt_len, now in global order
    prompts = store.text("prompts.jsonl")
    assert [r["i"] for r in prompts] == list(range(7))
    assert prompts[4]["prompt"] == PROMPTS[(4 // 3) % len(PROMPTS)]
    for g, x in enumerate(acts):
        for layer in range(L):
            np.testing.assert_array_equal(store.read(g, layer), x[layer])


def _same_store(a: ActivationStore, b: ActivationStore):
    assert (len(a), a.num_layers, a.t_max, a.hidden_size) == (
        len(b), b.num_layers, b.t_max, b.hidden_size)  # fmt: skip
    np.testing.assert_array_equal(a.seq_len, b.seq_len)
    assert a.chunks == b.chunks
    for name, values in a.arrays.items():
        assert b.arrays[name].dtype == values.dtype
        np.testing.assert_array_equal(b.arrays[name], values)
    np.testing.assert_array_equal(a.sample_keys, b.sample_keys)
    for name in ("prompts.jsonl", "responses.jsonl", "extra_metadata.jsonl"):
        assert a.text(name) == b.text(name)
    assert {k: b.attrs.get(k) for k in a.attrs} == a.attrs  # every global attribute kept
    for i in range(len(a)):
        for layer in range(a.num_layers):
            assert a.read(i, layer).tobytes() == b.read(i, layer).tobytes()


def test_store_to_dataset_and_back_is_exact(seed_store, tmp_path):
    path, acts = seed_store
    ds = convert(path, tmp_path / "ds", to="safetensors", workers=2, progress=False)
    from pyspark_safetensors.dataset import load_manifest

    manifest = load_manifest(ds)
    assert manifest.mode == "kv" and manifest.total_samples == len(acts)
    assert json.loads(manifest.metadata["zarr_attrs"])["model_id"] == "tiny/model"
    back = convert(ds, tmp_path / "back.zarr", to="zarr", workers=2, progress=False)
    _same_store(ActivationStore(path), ActivationStore(back))
    assert verify_store(back).startswith(f"{back}: Zarr activation store, 6 samples")


def test_kv_dataset_is_readable_by_the_torch_reader(seed_store, tmp_path):
    pytest.importorskip("torch")
    from pyspark_safetensors.torch import open_dataset

    path, acts = seed_store
    ds = open_dataset(convert(path, tmp_path / "ds", to="safetensors", progress=False))
    key = f"{3:064x}"
    np.testing.assert_array_equal(ds.get(key, "layer_2").numpy(), acts[3][2])
    f32 = open_dataset(
        convert(path, tmp_path / "f32", to="safetensors", dtype="F32", progress=False)
    )
    np.testing.assert_array_equal(f32.get(key, "layer_0").numpy(), acts[3][0].astype(np.float32))


def test_run_to_dataset_keeps_the_global_order(tmp_path):
    acts, lengths = _samples(5, seed=2)
    run_dir = write_seed_run(tmp_path / "run", acts, lengths, shards=2)
    ds = convert(run_dir, tmp_path / "ds", to="safetensors", progress=False)
    back = ActivationStore(convert(ds, tmp_path / "back.zarr", to="zarr", progress=False))
    assert [back.sample_key(g) for g in range(5)] == [f"key-{g}" for g in range(5)]
    for g, x in enumerate(acts):
        np.testing.assert_array_equal(back.read(g, 1), x[1])


def test_writer_output_follows_the_layout(tmp_path):
    acts, _ = _samples(4, seed=3)
    with StoreWriter(tmp_path / "w.zarr", num_layers=L, hidden_size=H, t_max=T_MAX,
                     model_id="m", attrs={"git_commit": "abc"}) as w:  # fmt: skip
        for i, x in enumerate(acts):
            w.add(x.astype(np.float32), sample_key=f"k{i}", split=i % 2, prompt="é")
    meta = json.loads((tmp_path / "w.zarr/arrays/activations/.zarray").read_text())
    assert meta["compressor"] is None and meta["filters"] is None and meta["order"] == "C"
    assert meta["chunks"] == [1, 1, T_MAX, H] and meta["dtype"] == "<f2"
    assert meta["fill_value"] == 0
    store = ActivationStore(tmp_path / "w.zarr")
    assert store.attrs["git_commit"] == "abc" and store.attrs["T_max"] == T_MAX
    assert store.arrays["split"].dtype == np.int8 and store.sample_keys.dtype == np.dtype("S64")
    for i, x in enumerate(acts):
        np.testing.assert_array_equal(store.read(i, 0), x[0])
    assert token_chunk(2048, 4096) == 256 and token_chunk(64, 384) == 64
    assert 512 * 1024 <= token_chunk(4096, 1024) * 1024 * 2 <= 2 << 20


def test_writer_refuses_inconsistent_input_and_leaves_nothing(tmp_path):
    def writer():
        return StoreWriter(tmp_path / "a.zarr", num_layers=L, hidden_size=H, t_max=T_MAX)

    with pytest.raises(ZarrStoreError, match="seq_len 13 > T_max 12"), writer() as w:
        w.add(np.zeros((L, 13, H), np.float16))
    with (
        pytest.raises(ZarrStoreError, match="split given for some samples but not sample 1"),
        writer() as w,
    ):
        w.add(np.zeros((L, 2, H), np.float16), split=1)
        w.add(np.zeros((L, 2, H), np.float16))
    assert os.listdir(tmp_path) == []


def test_run_manifest_written_by_our_writer(tmp_path):
    acts, _ = _samples(4, seed=4)
    placement = []
    for s in range(2):
        with StoreWriter(tmp_path / "run" / f"shards/shard-{s:04d}.zarr", num_layers=L,
                         hidden_size=H, t_max=T_MAX, model_id="m") as w:  # fmt: skip
            for g in range(s, 4, 2):
                placement.append((g, s, w.add(acts[g])))
    placement.sort()
    doc = write_run_manifest(tmp_path / "run", [(s, j) for _, s, j in placement])
    assert doc["num_shards"] == 2 and doc["total_samples"] == 4
    run = ActivationRun(tmp_path / "run")
    for g, x in enumerate(acts):
        np.testing.assert_array_equal(run.read(g, 2), x[2])


def test_dataloader_with_two_spawned_workers(seed_store):
    torch = pytest.importorskip("torch")
    from pyspark_safetensors.interop.zarr import PairDataset, RandomPairs, collate_pairs

    path, acts = seed_store
    store = ActivationStore(path)
    sampler = RandomPairs(store, samples_per_batch=2, seed=1)
    loader = torch.utils.data.DataLoader(
        PairDataset(store), batch_sampler=sampler, collate_fn=collate_pairs,
        num_workers=2, multiprocessing_context="spawn",
    )  # fmt: skip
    seen = []
    for batch in loader:
        assert batch["acts"].shape[0] == 2 * len(set(batch["sample"].tolist()))
        for row, (i, layer) in enumerate(zip(batch["sample"], batch["layer"], strict=True)):
            n = int(batch["seq_len"][row])
            np.testing.assert_array_equal(batch["acts"][row, :n].numpy(), acts[i][layer])
            seen.append(int(i))
        pairs = list(zip(batch["sample"].tolist(), batch["layer"].tolist(), strict=True))
        assert len(set(pairs)) == len(pairs)  # two distinct layers per sample
    assert sorted(set(seen)) == list(range(len(acts))) and len(seen) == 2 * len(acts)


# -- bad input


def test_compressed_store_reads_with_a_warning(tmp_path):
    acts, lengths = _samples(3, seed=5)
    numcodecs = pytest.importorskip("numcodecs")
    path = write_seed_store(tmp_path / "c.zarr", acts, lengths, compressors=numcodecs.Zlib(1))
    with pytest.warns(PerformanceWarning, match="compress"):
        store = ActivationStore(path)
    assert not store.fast
    np.testing.assert_array_equal(store.read(2, 1), acts[2][1])
    with pytest.warns(PerformanceWarning, match="compress"):
        ds = convert(path, tmp_path / "ds", to="safetensors", progress=False)
    assert (ds / "dataset_manifest.json").is_file()


def test_chunks_spanning_layers_warn(tmp_path):
    acts, lengths = _samples(3, seed=6)
    path = write_seed_store(tmp_path / "s.zarr", acts, lengths, chunks=(1, L, T_MAX, H))
    with pytest.warns(PerformanceWarning, match="span several samples or layers"):
        store = ActivationStore(path)
    np.testing.assert_array_equal(store.read(1, 2), acts[1][2])


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda root: root.__delitem__("arrays/seq_len"), "no array arrays/seq_len"),
        (lambda root: root["arrays/seq_len"].__setitem__(2, T_MAX + 1), "sample 2 has seq_len 13"),
        (lambda root: _replace(root, "arrays/activations", (4, L, T_MAX * H), "float16"), "rank 3"),
        (lambda root: _replace(root, "arrays/activations", (4, L, T_MAX, H), "float32"), "dtype float32"),
        (lambda root: _replace(root, "arrays/split", (3,), "int8"), "arrays/split: shape"),
    ],
)  # fmt: skip
def test_bad_stores_fail_naming_the_array(tmp_path, damage, message):
    acts, lengths = _samples(4, seed=7)
    path = write_seed_store(tmp_path / "bad.zarr", acts, lengths)
    damage(zarr.open_group(str(path), mode="a", zarr_format=2))
    zarr.consolidate_metadata(str(path))
    with pytest.raises(ZarrStoreError, match=message):
        ActivationStore(path)


def _replace(root, name, shape, dtype):
    del root[name]
    root.create_array(name, shape=shape, dtype=dtype, compressors=None, fill_value=0)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda doc: doc["shards"].append({"shard_id": 9, "path": "shards/shard-0009.zarr",
                                           "num_samples": 1}) or doc.update(num_shards=3),
         "shard 'shards/shard-0009.zarr' is missing"),
        (lambda doc: doc["samples"][0].update(global_index=doc["samples"][1]["global_index"]),
         "appears twice"),
        (lambda doc: doc.pop("T_max"), "missing key"),
        (lambda doc: doc["samples"][0].update(local_index=99), "local_index 99 outside"),
    ],
)  # fmt: skip
def test_bad_run_manifests_fail_naming_the_problem(tmp_path, damage, message):
    acts, lengths = _samples(4, seed=8)
    run_dir = write_seed_run(tmp_path / "run", acts, lengths)
    doc = json.loads((run_dir / "manifest.json").read_text())
    damage(doc)
    (run_dir / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(ZarrStoreError, match=message):
        ActivationRun(run_dir)


def test_cli_failure_is_one_line_and_leaves_nothing(tmp_path, capsys):
    acts, lengths = _samples(4, seed=9)
    run_dir = write_seed_run(tmp_path / "run", acts, lengths)
    bad = run_dir / "shards" / "shard-0001.zarr"
    del zarr.open_group(str(bad), mode="a", zarr_format=2)["arrays/seq_len"]
    zarr.consolidate_metadata(str(bad))
    for args in (["convert", str(bad), str(tmp_path / "out"), "--to", "safetensors"],
                 ["convert", str(run_dir), str(tmp_path / "out"), "--to", "zarr"],
                 ["convert", str(run_dir), str(tmp_path / "out"), "--to", "safetensors"],
                 ["verify", str(run_dir)]):  # fmt: skip
        assert cli(args) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and "seq_len" in err and str(bad) in err
    assert sorted(os.listdir(tmp_path)) == ["run"]


def test_cli_converts_and_verifies(seed_store, tmp_path, capsys):
    path, _ = seed_store
    assert cli(["convert", str(path), str(tmp_path / "ds"), "--to", "safetensors"]) == 0
    assert cli(["convert", str(tmp_path / "ds"), str(tmp_path / "z.zarr"), "--to", "zarr"]) == 0
    assert cli(["verify", str(tmp_path / "z.zarr")]) == 0
    assert "Zarr activation store, 6 samples x 3 layers" in capsys.readouterr().out
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ActivationStore(tmp_path / "z.zarr")  # our output warns about nothing
    with pytest.raises(ConversionError):
        convert(path, tmp_path / "nope", to="zarr")  # no zarr -> zarr converter


def test_saev_dump_to_store_rounds_to_nearest_even(tmp_path):
    from pyspark_safetensors.interop.saev import write_dump

    rng = np.random.default_rng(10)
    acts = rng.standard_normal((5, 2, 4, 6)).astype(np.float32)  # 5 images, L=2, T=3+CLS
    acts[0, 0, 0, :3] = [1 + 2**-11, 1 + 3 * 2**-11, 70000.0]  # ties to even; overflow to inf
    dump = write_dump(tmp_path / "dumps", acts, vit_family="clip", vit_ckpt="tiny",
                      layers=[3, 5], n_patches_per_img=3, cls_token=True, seed=0,
                      max_patches_per_shard=2 * 2 * 4, data="unit")  # fmt: skip
    assert detect_source(tmp_path / "dumps") == "saev"
    assert cli(["convert", str(tmp_path / "dumps"), str(tmp_path / "s.zarr"), "--to", "zarr",
                "--workers", "2"]) == 0  # fmt: skip
    store = ActivationStore(tmp_path / "s.zarr")
    assert (len(store), store.num_layers, store.t_max, store.hidden_size) == (5, 2, 4, 6)
    np.testing.assert_array_equal(store.seq_len, [4] * 5)
    assert store.attrs["layers"] == [3, 5] and store.attrs["saev_hash"] == dump.name
    assert store.attrs["saev_metadata"]["vit_ckpt"] == "tiny"
    for i in range(5):
        for layer in range(2):
            with np.errstate(over="ignore"):  # 70000 -> inf is the point
                expected = acts[i, layer].astype(np.float16)  # numpy rounds to nearest even
            assert store.read(i, layer).tobytes() == expected.tobytes()
    assert store.read(0, 0)[0, :3].tolist() == [1.0, 1 + 2 * 2**-10, float("inf")]


def test_direct_chunk_writes_equal_zarrs_own(tmp_path):
    """The writer's direct chunk files and zarr-python's writes are byte-identical,
    including an edge chunk past T_max (T_max 7, T_chunk 4)."""
    rng = np.random.default_rng(11)
    acts = [rng.standard_normal((2, n, 4)).astype(np.float16) for n in (7, 3, 5, 0)]
    for direct in (True, False):
        with StoreWriter(tmp_path / f"{direct}.zarr", num_layers=2, hidden_size=4, t_max=7,
                         t_chunk=4, direct=direct) as w:  # fmt: skip
            for x in acts:
                w.add(x)
    ours, theirs = (tmp_path / f"{d}.zarr/arrays/activations" for d in (True, False))
    names = sorted(p.name for p in theirs.iterdir() if not p.name.startswith("."))
    assert names == sorted(p.name for p in ours.iterdir() if not p.name.startswith("."))
    assert "0.1.1.0" in names and not any(n.startswith("3.") for n in names)
    for name in names:
        assert (ours / name).read_bytes() == (theirs / name).read_bytes(), name
    store = ActivationStore(tmp_path / "True.zarr", fast=False)
    for i, x in enumerate(acts):
        np.testing.assert_array_equal(store.read(i, 1), x[1])


def test_writer_takes_samples_from_threads_in_any_order(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    acts, _ = _samples(8, seed=12)
    path = tmp_path / "t.zarr"
    with (
        StoreWriter(path, num_layers=L, hidden_size=H, t_max=T_MAX, num_samples=8) as w,
        ThreadPoolExecutor(4) as pool,
    ):
        list(pool.map(lambda i: w.put(i, acts[i], split=i % 3, sample_key=f"k{i}"),
                      [5, 0, 7, 2, 1, 6, 3, 4]))  # fmt: skip
    store = ActivationStore(path)
    assert [store.sample_key(i) for i in range(8)] == [f"k{i}" for i in range(8)]
    np.testing.assert_array_equal(store.arrays["split"], np.arange(8) % 3)
    for i, x in enumerate(acts):
        np.testing.assert_array_equal(store.read(i, 2), x[2])
    with (
        pytest.raises(ZarrStoreError, match=r"7 of num_samples=8 samples written \(sample 3"),
        StoreWriter(tmp_path / "u.zarr", num_layers=L, hidden_size=H, t_max=T_MAX,
                    num_samples=8) as w,
    ):  # fmt: skip
        for i in (0, 1, 2, 4, 5, 6, 7):
            w.put(i, acts[i])
    assert not (tmp_path / "u.zarr").exists()


def test_extract_output_keys_fit_the_store(tmp_path):
    """The extraction's Zarr output keeps a key the store takes and stores a longer one (a
    window's ``{sha256}-w{i}``) as its sha256, which the writer accepts."""
    import hashlib

    from pyspark_safetensors.interop.zarr.extract_output import zarr_sample_key

    text_key = hashlib.sha256(b"a text").hexdigest()
    window_key = f"{text_key}-w1"
    assert zarr_sample_key(text_key) == text_key
    assert zarr_sample_key(window_key) == hashlib.sha256(window_key.encode()).hexdigest()
    acts, _ = _samples(2, seed=5)
    with StoreWriter(tmp_path / "k.zarr", num_layers=L, hidden_size=H, t_max=T_MAX) as w:
        w.add(acts[0], sample_key=zarr_sample_key(text_key))
        w.add(acts[1], sample_key=zarr_sample_key(window_key))
        with pytest.raises(ZarrStoreError, match="at most 64"):
            w.add(acts[1], sample_key=window_key)  # what the output never passes
    store = ActivationStore(tmp_path / "k.zarr")
    assert store.sample_key(0) == text_key and len(store.sample_key(1)) == 64
