"""Views of a saev dump (protocol §5): every view's length and index transform against a
brute-force reference enumerated from the full [img, layer, token, dim] array."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pyspark_safetensors.interop.saev import DumpError, SaevDump, View, parse_metadata


@st.composite
def metadata(draw, saev_real):
    layers = draw(st.lists(st.integers(-24, 23), min_size=1, max_size=3, unique=True))
    cls_token = draw(st.booleans())
    n_patches = draw(st.integers(1, 6))
    T = n_patches + int(cls_token)
    per_shard = draw(st.integers(1, 4))
    budget = per_shard * len(layers) * T + draw(st.integers(0, len(layers) * T - 1))
    n_imgs = draw(st.integers(1, 11))
    d = draw(st.integers(1, 3))
    return saev_real.metadata(layers, n_patches, cls_token, d, n_imgs, budget)


def views(meta):
    for patches in ("cls", "image", "all") if meta.cls_token else ("image", "all"):
        for layer in (*meta.layers, "all"):
            yield patches, layer


def reference(meta, patches, layer):
    """(img, layer position, token) of each row, enumerated in the table's order."""
    layer_pos = range(meta.n_layers) if layer == "all" else [meta.layers.index(layer)]
    first = int(meta.cls_token)
    tokens = {
        "cls": [0],
        "image": range(first, meta.n_tokens_per_img),
        "all": range(meta.n_tokens_per_img),
    }[patches]
    return [(i, li, t) for i in range(meta.n_imgs) for li in layer_pos for t in tokens]


def expected_length(meta, patches, layer):
    L = meta.n_layers if layer == "all" else 1
    per = {"cls": 1, "image": meta.n_patches_per_img, "all": meta.n_tokens_per_img}[patches]
    return meta.n_imgs * L * per


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_view_lengths_and_transforms_match_brute_force(saev_real, data):
    doc = data.draw(metadata(saev_real))
    meta = parse_metadata(doc, "metadata.json")
    assert meta.n_imgs_per_shard == doc["max_patches_per_shard"] // (
        len(doc["layers"]) * meta.n_tokens_per_img
    )
    for patches, layer in views(meta):
        view = View(meta, patches, layer)
        ref = reference(meta, patches, layer)
        assert len(view) == len(ref) == expected_length(meta, patches, layer)
        img, layer_pos, token = view.locate(np.arange(len(view)))
        assert list(zip(img.tolist(), layer_pos.tolist(), token.tolist(), strict=True)) == ref
        coords = view.coordinates(np.arange(len(view)))
        assert (coords["layer"] == np.array(meta.layers)[layer_pos]).all()
        is_cls = (token == 0) if meta.cls_token else np.zeros(len(token), bool)
        assert (coords["patch"][is_cls] == -1).all()
        assert (coords["patch"][~is_cls] == token[~is_cls] - int(meta.cls_token)).all()
        assert sum(view.shard_rows(s) for s in range(meta.n_shards)) == len(view)
        with pytest.raises(IndexError):
            view.locate([len(view)])


@settings(max_examples=25, deadline=None)
@given(data=st.data(), pad=st.booleans())
def test_reading_views_from_shards_matches_the_full_array(saev_real, data, pad):
    doc = data.draw(metadata(saev_real))
    meta = parse_metadata(doc, "metadata.json")
    shape = (meta.n_imgs, meta.n_layers, meta.n_tokens_per_img, meta.d_vit)
    full = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    with tempfile.TemporaryDirectory() as tmp:
        root = saev_real.write(Path(tmp), doc, full, pad=pad)
        S = meta.n_imgs_per_shard
        for s, f in enumerate(sorted(root.glob("acts*.bin"))):  # byte-exact shard sizes
            n = S if pad else meta.imgs_in_shard(s)
            assert f.stat().st_size == n * meta.n_layers * meta.n_tokens_per_img * meta.d_vit * 4
        dump = SaevDump(root)
        assert np.array_equal(dump.images(0, meta.n_imgs), full)
        for patches, layer in views(meta):
            view = dump.view(patches, layer)
            got = dump.gather(*view.locate(np.arange(len(view))))
            want = np.stack([full[i, li, t] for i, li, t in reference(meta, patches, layer)])
            assert np.array_equal(got, want)
        img, li, t = reference(meta, "all", "all")[-1]
        assert np.array_equal(dump.vector(img, meta.layers[li], t), full[img, li, t])


def test_a_layer_not_recorded_names_the_valid_layers(saev_real):
    meta = parse_metadata(saev_real.metadata([-2, 5], 4, False, 3, 7, 50), "m")
    with pytest.raises(DumpError, match=r"layer 3 is not in this dump; its layers are \[-2, 5\]"):
        View(meta, "image", 3)
    with pytest.raises(DumpError, match="no CLS token"):
        View(meta, "cls", "all")
    with pytest.raises(DumpError, match="choose 'cls', 'image' or 'all'"):
        View(meta, "patches", "all")
