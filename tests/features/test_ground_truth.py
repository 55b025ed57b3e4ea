"""Ground truth: the exact AUROC of every latent from a sparse code equals the direct
pairwise count (ties one half), and each factor value gets its best latent."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from pyspark_safetensors.features.ground_truth import (
    auroc_dense,
    auroc_sparse,
    factor_masks,
    ground_truth_table,
)


def pairwise_auroc(scores: np.ndarray, positive: np.ndarray) -> float:
    """P(score of a positive > score of a negative) + P(tie) / 2, over every pair."""
    pos, neg = scores[positive], scores[~positive]
    greater = (pos[:, None] > neg[None, :]).sum()
    ties = (pos[:, None] == neg[None, :]).sum()
    return (greater + ties / 2) / (len(pos) * len(neg))


def random_code(rng, n: int, latents: int, k: int):
    """A sparse code with many ties: values on a coarse grid, some slots silent (0), the
    same latent never twice in a row."""
    indices = np.argsort(rng.random((n, latents)), axis=1)[:, :k]
    values = rng.integers(0, 4, (n, k)) * 0.5  # 0 (silent), 0.5, 1.0, 1.5: ties everywhere
    dense = np.zeros((n, latents))
    np.put_along_axis(dense, indices, values, 1)
    return values, indices, dense


def test_auroc_equals_the_pairwise_count_with_ties():
    rng = np.random.default_rng(0)
    values, indices, dense = random_code(rng, 300, 12, 5)
    positive = rng.random(300) < 0.3
    positive[dense[:, 3] > 0.9] = True  # latent 3 leans positive
    want = np.array([pairwise_auroc(dense[:, j], positive) for j in range(12)])
    np.testing.assert_allclose(auroc_dense(dense, positive), want, rtol=0, atol=1e-12)
    np.testing.assert_allclose(
        auroc_sparse(values, indices, positive, 12), want, rtol=0, atol=1e-12
    )
    assert want[3] > 0.6 and len(set(np.round(want, 6))) > 6  # not a degenerate case


def test_auroc_edge_cases():
    positive = np.array([True, True, False, False])
    perfect = np.array([[2.0], [1.0], [0.0], [0.0]])
    assert auroc_dense(perfect, positive)[0] == 1.0
    assert auroc_dense(-perfect, positive)[0] == 0.0
    assert auroc_dense(np.zeros((4, 1)), positive)[0] == 0.5  # all tied
    values, indices = np.array([[2.0], [1.0], [0.0], [0.0]]), np.zeros((4, 1), np.int64)
    got = auroc_sparse(values, indices, positive, 3)
    assert got.tolist() == [1.0, 0.5, 0.5]  # latents 1 and 2 never fire: a tie, 0.5
    assert np.isnan(auroc_sparse(values, indices, np.ones(4, bool), 3)).all()
    negative_only = np.array([[0.0], [0.0], [1.0], [0.0]])  # fires on a negative: below 1/2
    assert auroc_dense(negative_only, positive)[0] == 0.25


def test_each_factor_value_gets_the_latent_that_detects_it():
    rng = np.random.default_rng(1)
    n = 400
    shape = rng.choice(np.array(["circle", "square", None], dtype=object), n, p=[0.2, 0.2, 0.6])
    colour = np.where(shape == None, None, rng.choice(["red", "blue"], n))  # noqa: E711
    labels = pa.table({"image_id": np.arange(n) // 16, "patch_row": np.arange(n) % 4,
                       "patch_col": np.arange(n) // 4 % 4, "shape": list(shape),
                       "colour": list(colour)})  # fmt: skip
    masks = factor_masks(labels)
    assert sorted(masks) == [("colour", "blue"), ("colour", "red"), ("shape", "circle"),
                             ("shape", "square")]  # fmt: skip
    values, indices, _ = random_code(rng, n, 10, 3)
    # latent 7 fires on circles only (one miss), latent 2 on red patches and a few others
    circle, red = masks[("shape", "circle")], masks[("colour", "red")]
    values[:, 0] = np.where(circle, 2.0, 0.0)
    values[np.flatnonzero(circle)[0], 0] = 0.0
    indices[:, 0] = 7
    values[:, 1] = np.where(red | (rng.random(n) < 0.05), 1.5, 0.0)
    indices[:, 1] = 2
    indices[:, 2] = np.where(np.isin(indices[:, 2], [2, 7]), 0, indices[:, 2])
    table = ground_truth_table(values, indices, masks, 10).to_pylist()
    by = {(r["factor"], r["value"]): r for r in table}
    assert by[("shape", "circle")]["latent"] == 7 and by[("colour", "red")]["latent"] == 2
    dense = np.zeros((n, 10))
    np.put_along_axis(dense, indices, np.maximum(values, 0), 1)
    for (factor, value), row in by.items():
        inside = masks[(factor, value)]
        scores = [pairwise_auroc(dense[:, j], inside) for j in range(10)]
        assert row["auroc"] == pytest.approx(max(scores), abs=1e-12)
        assert row["latent"] == int(np.argmax(scores))
        assert row["second_auroc"] == pytest.approx(sorted(scores)[-2], abs=1e-12)
        assert row["positives"] == inside.sum() and row["negatives"] == n - inside.sum()
    assert by[("shape", "circle")]["auroc"] > 0.99 and by[("colour", "red")]["auroc"] > 0.9
    assert by[("shape", "circle")]["fires_outside"] == 0.0


def test_a_per_image_table_equals_its_per_patch_form(tmp_path):
    """``labels.parquet`` as the toy ViT's image set writes it (one row per image, a
    ``patch_mask``, images named by path) reads as the per-patch table it stands for."""
    import pyarrow.parquet as pq

    from pyspark_safetensors.features.ground_truth import read_factors
    from pyspark_safetensors.features.images import ImageLayout

    layout = ImageLayout(rows=2, cols=3, n_registers=1, tokens=8)
    per_image = pa.table({
        "path": ["circle/000.png", "square/001.png"], "index": [0, 1],
        "shape": ["circle", "square"], "colour": ["red", "red"], "x": [3.0, 9.5],
        "patch_mask": [[True, False, False, True, False, False], [False] * 5 + [True]],
    })  # fmt: skip
    images = pa.table({"image_id": [5, 9], "key": ["square/001.png", "circle/000.png"],
                       "path": ["/d/square/001.png", "/d/circle/000.png"]})  # fmt: skip
    pq.write_table(per_image, tmp_path / "labels.parquet")
    got = read_factors(str(tmp_path / "labels.parquet"), layout, images)
    rows = [(9, r, c) for r in range(2) for c in range(3)] + [
        (5, r, c) for r in range(2) for c in range(3)]  # fmt: skip
    inside = {(9, 0, 0): "circle", (9, 1, 0): "circle", (5, 1, 2): "square"}
    per_patch = pa.table({
        "image_id": [i for i, _, _ in rows], "patch_row": [r for _, r, _ in rows],
        "patch_col": [c for _, _, c in rows], "shape": [inside.get(p) for p in rows],
        "colour": ["red" if p in inside else None for p in rows],
    })  # fmt: skip
    pq.write_table(per_patch, tmp_path / "patches.parquet")
    want = read_factors(str(tmp_path / "patches.parquet"), layout)
    assert got.ids.tolist() == want.ids.tolist()
    assert got.ids.tolist()[:2] == [(9 << 28) | 2, (9 << 28) | 3]  # after CLS and a register
    assert sorted(got.masks) == sorted(want.masks) == [("colour", "red"), ("shape", "circle"),
                                                       ("shape", "square")]  # fmt: skip
    for key in want.masks:
        assert got.masks[key].tolist() == want.masks[key].tolist()
    assert got.masks[("colour", "red")].sum() == 3
