"""Reading, writing and verifying saev dumps: the layouts real dumps have (padded last
shard, an extra all-padding shard, the renamed budget key, the compact-hash variant, shards
cut as the seed allows), our writer's bytes against saev's conventions, and every error."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from pyspark_safetensors.interop.saev import (
    DumpError,
    DumpWriter,
    SaevDump,
    find_dump,
    metadata_hash,
    new_metadata,
    verify_dump,
    write_dump,
)


def _acts(n, L=2, T=5, d=3, seed=0):
    return np.random.default_rng(seed).standard_normal((n, L, T, d)).astype(np.float32)


def test_a_real_dump_reads_back_and_verifies(small_dump):
    root, acts = small_dump
    sizes = sorted((p.name, p.stat().st_size) for p in root.glob("acts*.bin"))
    assert sizes == [(f"acts{s:06}.bin", 2 * 2 * 5 * 3 * 4) for s in range(4)]  # last padded
    dump = SaevDump(root.parent)  # the dump_to directory holding one hash directory
    assert dump.path == root and dump.hash_ok
    assert np.array_equal(dump.images(0, 7), acts)
    assert dump.shard(3).shape == (1, 2, 5, 3)  # padding is never data
    assert np.array_equal(dump.vector(6, -1, 0), acts[6, 1, 0])
    summary = verify_dump(root)
    assert "7 images x 2 layer(s) x 5 tokens x 3 in 4 shard(s) of 2 images; whole" in summary


@pytest.mark.parametrize(
    "variant",
    ["cut-last-shard", "extra-padding-shard", "n_patches_per_shard", "no-seed-compact-hash", "1.x"],
)
def test_layouts_found_in_the_wild(tmp_path, saev_real, variant):
    acts = _acts(6)
    changes, kw = {}, {}
    if variant == "cut-last-shard":
        kw["pad"] = False
    elif variant == "extra-padding-shard":
        kw["extra_shard"] = True
    elif variant == "n_patches_per_shard":  # the PyPI 0.1.0 release's key
        changes = {"max_patches_per_shard": None, "n_patches_per_shard": 25}
    elif variant == "no-seed-compact-hash":  # saev from 18 June 2025
        changes, kw["compact"] = {"seed": None}, True
    else:  # saev protocol 1.x: dtype and protocol keys, shards.json
        changes, kw["compact"] = {"seed": None, "dtype": "float32", "protocol": "1.0.0"}, True
    doc = saev_real.metadata([-2, -1], 4, True, 3, 6, 25, **changes)
    root = saev_real.write(tmp_path, doc, acts, **kw)
    if variant == "1.x":
        shards = [{"name": f"acts{s:06}.bin", "n_imgs": 2} for s in range(3)]
        (root / "shards.json").write_text(json.dumps(shards))
    summary = verify_dump(root)
    assert ("acts000003.bin holds only padding" in summary) == (variant == "extra-padding-shard")
    dump = SaevDump(root)
    assert dump.hash_ok and dump.meta.n_imgs_per_shard == 2
    assert np.array_equal(dump.images(0, 6), acts)
    if variant == "1.x":
        (root / "shards.json").write_text(json.dumps([{"name": "acts000002.bin", "n_imgs": 1}]))
        with pytest.raises(DumpError, match=r"shards.json: image counts"):
            verify_dump(root)


def test_protocol_2_is_refused_clearly(tmp_path):
    root = tmp_path / "1a2b3c4d"
    root.mkdir()
    doc = {
        "family": "clip", "ckpt": "x", "layers": [-2], "content_tokens_per_example": 4,
        "cls_token": True, "d_model": 3, "n_examples": 6, "max_tokens_per_shard": 25,
        "data": "gASVAAAA", "dataset": "/d", "dtype": "float32", "protocol": "2.1",
    }  # fmt: skip
    (root / "metadata.json").write_text(json.dumps(doc, indent=2))
    with pytest.raises(DumpError, match=r"protocol 2.1 dump .*only protocol 1 dumps"):
        SaevDump(root)


def test_our_writer_matches_saev_byte_for_byte(tmp_path, saev_real):
    acts = _acts(7)
    doc = saev_real.metadata([-2, -1], 4, True, 3, 7, 25)
    theirs = saev_real.write(tmp_path / "theirs", doc, acts)
    meta = new_metadata(**{k: doc[k] for k in doc})
    with DumpWriter(tmp_path / "ours", meta) as w:
        for a, b in [(0, 3), (3, 3), (3, 4), (4, 7)]:  # any batch sizes, across shards
            w.write(acts[a:b])
    assert w.path.name == theirs.name == metadata_hash(doc)
    ours = sorted(p.name for p in w.path.iterdir())
    assert ours == sorted(p.name for p in theirs.iterdir())
    for name in ours:
        assert (w.path / name).read_bytes() == (theirs / name).read_bytes(), name


def test_writer_stores_data_as_a_typed_dict(tmp_path):
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class ImageFolder:
        root: str
        use_flips: bool = False

    kw = dict(vit_family="dinov2", vit_ckpt="dinov2_vits14", layers=[11], n_patches_per_img=4)
    kw.update(cls_token=False, seed=0, max_patches_per_shard=8)
    path = write_dump(tmp_path, _acts(3, 1, 4), data=ImageFolder("imgs"), **kw)
    doc = json.loads((path / "metadata.json").read_text())
    assert list(doc) == [
        "vit_family", "vit_ckpt", "layers", "n_patches_per_img", "cls_token", "d_vit", "seed",
        "n_imgs", "max_patches_per_shard", "data",
    ]  # fmt: skip
    assert doc["data"] == {"root": "imgs", "use_flips": False, "type": "ImageFolder"}
    assert (path / "metadata.json").read_text() == json.dumps(doc, indent=4)
    assert path.name == metadata_hash(doc)
    with pytest.raises(DumpError, match="'type' key"):
        new_metadata(data={"root": "x"}, d_vit=3, n_imgs=1, **kw)


def test_an_incomplete_write_leaves_nothing(tmp_path):
    kw = dict(vit_family="clip", vit_ckpt="x", layers=[-2], n_patches_per_img=4, cls_token=True)
    meta = new_metadata(d_vit=3, seed=0, n_imgs=5, max_patches_per_shard=10, data="d", **kw)
    with (
        pytest.raises(DumpError, match=r"3 images written; metadata\.json says n_imgs=5"),
        DumpWriter(tmp_path / "shards", meta) as w,
    ):
        w.write(_acts(3, 1))
    with pytest.raises(RuntimeError), DumpWriter(tmp_path / "shards", meta) as w:
        w.write(_acts(2, 1))
        raise RuntimeError("inference failed")
    assert not (tmp_path / "shards").exists()
    with (
        pytest.raises(DumpError, match=r"this dump takes \[n, 1, 5, 3\]"),
        DumpWriter(tmp_path / "shards", meta) as w,
    ):
        w.write(_acts(2, 2))
    assert not (tmp_path / "shards").exists()


def test_truncated_and_missing_shards_are_all_reported(small_dump):
    root, _ = small_dump
    with open(root / "acts000001.bin", "r+b") as f:
        f.truncate(100)
    (root / "acts000002.bin").unlink()
    (root / "acts000003.bin").unlink()
    with pytest.raises(DumpError) as e:
        verify_dump(root)
    msg = str(e.value)
    assert "missing shard(s) acts000002.bin, acts000003.bin of 4 for 7 images" in msg
    assert "acts000001.bin has 100 bytes; expected 240 (shard shape [2, 2, 5, 3] float32)" in msg
    with pytest.raises(DumpError, match=r"acts000001\.bin has 100 bytes"):
        SaevDump(root)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"d_vit": None}, "missing key(s) 'd_vit'"),
        ({"vit_family": "vit"}, "'vit_family' is 'vit'; protocol v1 knows"),
        ({"n_imgs": 0}, "'n_imgs' must be positive, got 0"),
        ({"n_patches_per_img": -1}, "'n_patches_per_img' must be positive"),
        ({"layers": "-2"}, "'layers' must be a non-empty list of integers"),
        ({"cls_token": 1}, "'cls_token' must be true or false"),
        ({"d_vit": 3.0}, "'d_vit' must be an integer"),
        ({"max_patches_per_shard": 9}, "holds no whole image of 2 layer"),
        ({"n_patches_per_shard": 25}, "exactly one shard budget key"),
        ({"dtype": "float16"}, "'dtype' is 'float16'"),
    ],
)
def test_bad_metadata_names_the_key(tmp_path, saev_real, change, message):
    doc = saev_real.metadata([-2, -1], 4, True, 3, 7, 25, **change)
    root = tmp_path / "dump"
    root.mkdir()
    (root / "metadata.json").write_text(json.dumps(doc, indent=4))
    with pytest.raises(DumpError, match="metadata.json: .*" + _re(message)):
        verify_dump(root)


def _re(text):
    import re

    return re.escape(text)


def test_wrong_hash_directory_is_a_warning(small_dump):
    root, _ = small_dump
    moved = root.rename(root.parent / "renamed")
    with pytest.warns(UserWarning, match="directory name 'renamed' is not the metadata hash"):
        summary = verify_dump(moved)
    assert "is not the metadata hash" in summary and not SaevDump(moved).hash_ok


def test_layer_order_that_saev_may_have_permuted_is_flagged(tmp_path, saev_real):
    doc = saev_real.metadata([-2, 3], 4, True, 3, 2, 25)
    root = saev_real.write(tmp_path, doc, _acts(2))
    with pytest.warns(UserWarning, match="not in execution order"):
        verify_dump(root)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        verify_dump(
            saev_real.write(tmp_path / "b", saev_real.metadata([2, 3], 4, True, 3, 2, 25), _acts(2))
        )


def test_dump_to_with_several_dumps_is_ambiguous(tmp_path, saev_real):
    for n in (2, 3):
        saev_real.write(tmp_path, saev_real.metadata([-2, -1], 4, True, 3, n, 25), _acts(n))
    with pytest.raises(DumpError, match="holds 2 saev dumps"):
        find_dump(tmp_path)
    with pytest.raises(DumpError, match="no such directory"):
        find_dump(tmp_path / "x")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DumpError, match=r"no metadata\.json; give a saev hash directory"):
        find_dump(tmp_path / "empty")
