"""Global weights. Virtual weights equal an independent dense computation (the dictionary's
decoders and encoders laid out as one residual-stream matrix each, the stream's order a
mask): on the toy's random CLT from its file, and on a synthetic 4-layer CLT over
non-contiguous blocks; the top-k selection keeps what it says. Expected attributions
from the graph job, aggregated in Spark, equal a plain loop over the per-prompt graphs."""

from __future__ import annotations

import json
from collections import defaultdict

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.numpy import load_file

from pyspark_safetensors.circuits.replacement import Replacement
from pyspark_safetensors.format.errors import InvalidArgumentError
from pyspark_safetensors.graphs.global_weights import (
    expected_attributions,
    virtual_weight_blocks,
    virtual_weights,
)
from pyspark_safetensors.torch import open_dataset


def _dense_virtual(
    enc: list[np.ndarray], dec: dict[tuple[int, int], np.ndarray], layers
) -> np.ndarray:
    """``[L n, L n]`` (source feature, target feature): every decoder block placed at its
    target block's slot of a residual stream ``[L d]``, every encoder at its own block's,
    a block's write reaching a later block's read (``mask``)."""
    L, n, d = len(enc), enc[0].shape[0], enc[0].shape[1]
    D = np.zeros((L * n, L * d))
    for (s, t), w in dec.items():
        D[s * n : (s + 1) * n, t * d : (t + 1) * d] = w
    E = np.zeros((L * n, L * d))
    for u, w in enumerate(enc):
        E[u * n : (u + 1) * n, u * d : (u + 1) * d] = w
    mask = np.array([[layers[t] < layers[u] for u in range(L)] for t in range(L)], float)
    return D @ np.kron(mask, np.eye(d)) @ E.T


def test_virtual_weights_of_the_toy_clt(toy, dictionaries, tmp_path):
    summary = virtual_weights(toy, dictionaries["clt"], str(tmp_path))
    state = load_file(dictionaries["clt"])  # the reference reader, not ours
    L, n = state["encoder_weight"].shape[:2]
    enc = [state["encoder_weight"][u] for u in range(L)]
    dec = {(s, t): state[f"decoder_weight.{s}"][:, t - s] for s in range(L) for t in range(s, L)}
    want = _dense_virtual(enc, dec, list(range(L)))
    got = np.zeros_like(want)
    table = pq.read_table(tmp_path / "virtual_weights").to_pylist()
    for r in table:
        got[
            r["source_layer"] * n + r["source_latent"], r["target_layer"] * n + r["target_latent"]
        ] = r["weight"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert summary["pairs"] == len(table) == n * n * L * (L - 1) // 2
    assert (
        json.loads((tmp_path / "virtual_weights" / "_virtual_weights.json").read_text())["top_k"]
        == 0
    )


def test_virtual_weights_over_four_layers_and_top_k(toy, dictionaries, tmp_path):
    gen = torch.Generator().manual_seed(3)
    L, n, d, layers = 4, 6, 5, [0, 2, 3, 5]
    enc = [torch.randn(n, d, generator=gen) for _ in range(L)]
    decoders = [{s: torch.randn(n, d, generator=gen) for s in range(t + 1)} for t in range(L)]
    rep = Replacement(tuple(f"b{i}" for i in range(L)), enc, [torch.zeros(n)] * L, decoders,
                      [torch.zeros(d)] * L, k=2)  # fmt: skip
    want = _dense_virtual([e.numpy() for e in enc],
                          {(s, t): decoders[t][s].numpy() for t in range(L) for s in range(t + 1)}, layers)  # fmt: skip
    blocks = virtual_weight_blocks(rep, layers)
    for u in range(L):
        assert sorted(blocks[u]) == list(range(u))  # sources in earlier layers only
        for s, v in blocks[u].items():
            np.testing.assert_allclose(
                v, want[s * n : (s + 1) * n, u * n : (u + 1) * n], rtol=1e-5, atol=1e-5
            )
    # top-k on the toy: each target's 3 largest inputs and each source's 3 largest outputs kept
    virtual_weights(toy, dictionaries["clt"], str(tmp_path / "all"))
    virtual_weights(toy, dictionaries["clt"], str(tmp_path / "top"), top_k=3)
    full = pq.read_table(tmp_path / "all" / "virtual_weights").to_pandas()
    top = pq.read_table(tmp_path / "top" / "virtual_weights").to_pandas()
    key = ["source_layer", "source_latent", "target_layer", "target_latent"]
    merged = top.merge(full, on=key, suffixes=("", "_full"))
    assert len(merged) == len(top) < len(full)
    assert (merged.weight == merged.weight_full).all()
    full["abs"] = full.weight.abs()
    kept = set(map(tuple, top[key].to_numpy().tolist()))
    for by in (
        ["target_layer", "target_latent"],
        ["source_layer", "source_latent", "target_layer"],
    ):
        best = full.sort_values("abs", ascending=False).groupby(by, observed=True).head(3)
        assert set(map(tuple, best[key].to_numpy().tolist())) <= kept
    with pytest.raises(InvalidArgumentError, match="top_k"):
        virtual_weights(toy, dictionaries["clt"], str(tmp_path / "x"), top_k=-1)


@pytest.mark.spark
def test_expected_attributions_equal_the_loop_over_graphs(spark, graph_job, tmp_path):
    summary = expected_attributions(spark, str(graph_job), str(tmp_path), partitions=2)
    got = {(r.target_layer, r.target_latent, r.source_layer, r.source_latent): r
           for r in spark.read.parquet(summary["out"]).collect()}  # fmt: skip
    # the loop: every graph, every pair of feature nodes, plainly
    prompts = pq.read_table(graph_job / "graphs.parquet").to_pylist()
    adjacency = open_dataset(str(graph_job / "adjacency"))
    sums, weighted, counts, act_total = (
        defaultdict(float),
        defaultdict(float),
        defaultdict(int),
        defaultdict(float),
    )
    for p in prompts:
        if p["status"] != "ok":
            continue
        a = np.asarray(adjacency[f"p{p['prompt_id']}"]["adjacency"], np.float64)
        feats = [x for x in pq.read_table(graph_job / "nodes" / f"prompt_id={p['prompt_id']}").to_pylist()
                 if x["kind"] == "feature"]  # fmt: skip
        present = {(x["layer"], x["latent"]) for x in feats}
        for x in feats:
            act_total[(x["layer"], x["latent"])] += x["activation"]
        for t in present:
            for s in present:
                if s[0] < t[0]:
                    counts[(*t, *s)] += 1
                    sums[(*t, *s)] += 0.0
        for tx in feats:
            for sx in feats:
                if sx["layer"] < tx["layer"]:
                    k = (tx["layer"], tx["latent"], sx["layer"], sx["latent"])
                    sums[k] += a[tx["node"], sx["node"]]
                    weighted[k] += tx["activation"] * a[tx["node"], sx["node"]]
    assert got.keys() == counts.keys() and len(got) == summary["pairs"] > 0
    for k, r in got.items():
        assert r["count"] == counts[k]
        assert r["sum"] == pytest.approx(sums[k], rel=1e-6, abs=1e-9)
        assert r["mean"] == pytest.approx(sums[k] / counts[k], rel=1e-6, abs=1e-9)
        assert r["twera"] == pytest.approx(weighted[k] / act_total[k[:2]], rel=1e-6, abs=1e-9)
    assert any(abs(r["sum"]) > 1e-3 for r in got.values())
    assert sorted(p.name for p in (tmp_path / "expected_attributions").glob("target_layer=*")) == [
        "target_layer=1"
    ]
