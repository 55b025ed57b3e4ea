"""Exactness of attribution graphs: each edge is what perturbing its source does to its
target in the frozen local replacement model, each target's incoming edges plus its
constant term are its value, and the values are the model's own; with a cross-layer
transcoder and with per-layer transcoders. Then pruning, scores and interventions."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pyspark_safetensors.circuits import ReplacementError, ReplacementModel
from pyspark_safetensors.circuits.interventions import intervene
from pyspark_safetensors.graphs import graph as G
from pyspark_safetensors.graphs.attribution import (
    AttributionConfig,
    AttributionError,
    attribute,
    attribute_local,
    logit_directions,
)

PROMPT = "The quick brown fox jumps over the lazy dog"

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module", params=["clt", "per_layer", "skip", "skip:no_bos_nodes"])
def case(request, toy, dictionaries):
    """(local replacement model, its unpruned graph) of PROMPT; ``:no_bos_nodes``:
    circuit-tracer's convention, no nodes at position 0."""
    kind, _, convention = request.param.partition(":")
    rm = ReplacementModel.load(toy, dictionaries[kind])
    sources = [rm.replacement.sources(t) for t in range(rm.replacement.n_layers)]
    assert sources == [list(range(t + 1)) if kind == "clt" else [t]
                       for t in range(len(sources))]  # fmt: skip
    assert all((s is not None) == (kind == "skip") for s in rm.replacement.skip)
    ids = torch.tensor(rm.tokenizer(PROMPT)["input_ids"])
    local = rm.capture(ids, first_position=not convention)
    graph = attribute_local(local, AttributionConfig(batch_size=40), PROMPT)
    if convention:
        assert (graph.feature_pos > 0).all() and not local.errors[:, 0].any()
        assert local.fixed[:, 0].abs().amin(-1).gt(0).all()  # every block writes at BOS
        whole = rm.capture(ids)
        assert (whole.features.pos == 0).any()
        np.testing.assert_array_equal(local.logits, whole.logits)
    return local, graph


def _targets(local, graph, xs, final):
    """Every target's value in the frozen model: features' pre-activations, logit nodes."""
    dirs = logit_directions(local, torch.as_tensor(graph.logit_tokens))
    return torch.cat([local.pre_activations(xs), final @ dirs.T], 1)[0].double()


def test_edges_are_the_frozen_models_response_to_each_source(case):
    local, graph = case
    F, n_err = graph.n_features, graph.n_blocks * graph.n_pos
    rows = np.r_[0:F, graph.logit_start : graph.n_nodes]
    with torch.no_grad():
        base = _targets(local, graph, *local.run(*local.clean_sources()))
        rng = np.random.default_rng(0)
        reaching = np.flatnonzero(graph.adjacency[:, :F].any(0))  # features with out-edges
        picks = [
            *rng.choice(reaching, 6, replace=False),
            F + rng.integers(graph.n_pos),
            F + n_err + 3,
        ]
        picks.append(F + (graph.n_blocks - 1) * graph.n_pos + graph.n_pos - 1)  # last error
        eps = 0.37
        for src in picks:
            values, err, emb = local.clean_sources()
            if src < F:
                values[0, src] *= 1 + eps
            elif src < F + n_err:
                err.view(1, -1)[0, src - F] *= 1 + eps
            else:
                emb[0, src - F - n_err] *= 1 + eps
            moved = _targets(local, graph, *local.run(values, err, emb)) - base
            want = eps * graph.adjacency[rows, src].astype(np.float64)
            scale = max(np.abs(want).max(), 1e-3)
            np.testing.assert_allclose(moved.numpy(), want, atol=2e-5 * scale + 1e-6)
            assert np.abs(want).max() > 0  # every picked source reaches some target


def test_incoming_edges_and_constant_sum_to_the_models_own_values(case):
    local, graph = case
    F, rows = graph.n_features, np.r_[0 : graph.n_features, graph.logit_start : graph.n_nodes]
    total = graph.adjacency[rows].astype(np.float64).sum(1) + graph.bias[rows]
    rep, f = local.replacement, local.features
    x = torch.stack(
        [local.mlp_in[int(b)][int(p)] for b, p in zip(f.model_layer, f.pos, strict=True)]
    )
    w = torch.stack([rep.encoder_weight[a][c] for a, c in zip(f.layer, f.latent, strict=True)])
    b = torch.stack([rep.encoder_bias[a][c] for a, c in zip(f.layer, f.latent, strict=True)])
    pre = (x * w).sum(1) + b
    logits = local.logits[-1].double()
    want = np.r_[pre.detach().numpy(), (logits - logits.mean())[graph.logit_tokens].numpy()]
    np.testing.assert_allclose(total, want, rtol=1e-4, atol=1e-4)
    # active features are active: their pre-activation is their activation (ReLU, top-k)
    np.testing.assert_allclose(want[:F], graph.activations, rtol=1e-5, atol=1e-5)
    # no edge into errors or embeddings; none from a node to itself or a later feature layer
    assert not graph.adjacency[F : graph.logit_start].any()
    later = graph.feature_layer[:, None] <= graph.feature_layer[None, :]
    assert not graph.adjacency[:F, :F][later].any()


def test_logit_nodes_and_refusals(case):
    local, graph = case
    p = graph.logit_probabilities
    assert 1 <= len(p) <= 10 and (np.diff(p) <= 0).all()
    assert p.sum() >= 0.95 or len(p) == 10
    assert p[:-1].sum() < 0.95
    rm = local.replacement_model
    with pytest.raises(AttributionError, match="exceeds the model's 64"):
        attribute(rm, [0] * 65)
    with pytest.raises(AttributionError, match="non-empty"):
        attribute(rm, [])


def test_pruning_and_scores(case):
    _, graph = case
    replacement, completeness = G.scores(graph)
    assert 0 < replacement < 1 and 0 < completeness < 1
    pruned = G.prune(graph)
    keep = pruned.node_mask
    assert keep[graph.token_start :].all()  # tokens and logits always stay
    assert 0 < keep[: graph.n_features].sum() < graph.n_features
    assert not pruned.edge_mask[~keep].any() and not pruned.edge_mask[:, ~keep].any()
    assert (pruned.edge_mask <= (graph.adjacency != 0)).all()
    everything = G.prune(graph, 1.0, 1.0)
    assert everything.node_mask.sum() >= keep.sum()
    assert pruned.cumulative.max() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="node_threshold"):
        G.prune(graph, 1.5)


def test_scores_of_a_graph_made_by_hand():
    """token -> feature -> logit (weight 3) and token -> error -> logit (weight 1)."""
    a = np.zeros((5, 5), np.float32)  # nodes: feature, error, token, logit... (1 block, 1 pos)
    graph = G.AttributionGraph("", np.array([7]), np.array([0]), np.array([0]), np.array([5]),
                               np.array([1.0]), 1, np.array([2]), np.array([1.0]), a[:4, :4],
                               np.zeros(4), np.zeros(4))  # fmt: skip
    graph.adjacency[0, 2] = 2.0  # token -> feature
    graph.adjacency[3, 0], graph.adjacency[3, 1] = 3.0, -1.0  # feature, error -> logit
    replacement, completeness = G.scores(graph)
    # influence: feature 0.75, error 0.25, token 0.75 (through the feature); errors 0.25
    assert replacement == pytest.approx(0.75)
    # completeness: logit node weight 1 with 0.75 from non-errors; feature (0.75) fully
    assert completeness == pytest.approx((1 * 0.75 + 0.75 * 1 + 0.25 * 1 + 0.75 * 1) / 2.75)


def test_zeroing_a_feature_moves_each_logit_by_its_edge(case):
    local, graph = case
    F, rows = graph.n_features, slice(graph.logit_start, graph.n_nodes)
    top = int(np.abs(graph.adjacency[rows, :F]).sum(0).argmax())
    key = (
        int(graph.feature_layer[top]),
        int(graph.feature_pos[top]),
        int(graph.feature_latent[top]),
    )
    direct = intervene(local, {key: 0.0}, mode="direct")
    got = direct.demeaned_delta()[graph.logit_tokens].numpy()
    np.testing.assert_allclose(got, -graph.adjacency[rows, top], rtol=1e-4, atol=1e-5)
    doubled = intervene(local, {key: 2 * float(graph.activations[top])}).demeaned_delta()
    np.testing.assert_allclose(doubled[graph.logit_tokens].numpy(), graph.adjacency[rows, top],
                               rtol=1e-4, atol=1e-5)  # fmt: skip
    # "full" and "replaced" unchanged are the model itself
    for mode in ("full", "replaced"):
        same = intervene(local, {}, mode=mode)
        torch.testing.assert_close(same.clean, local.logits[-1], rtol=1e-5, atol=1e-5)
        assert same.delta.abs().max() == 0
    # a last-block feature at the last position reaches the logits directly only: the
    # full model moves them the way its edges say, though not by as much: the final norm is
    # live, and this random dictionary's outputs are a large part of the residual
    last = np.flatnonzero((graph.feature_layer == graph.n_blocks - 1)
                          & (graph.feature_pos == graph.n_pos - 1))  # fmt: skip
    f = int(last[np.abs(graph.adjacency[rows][:, last]).sum(0).argmax()])
    key = (int(graph.feature_layer[f]), int(graph.feature_pos[f]), int(graph.feature_latent[f]))
    moved = intervene(local, {key: 0.0}, mode="full").demeaned_delta()[graph.logit_tokens].numpy()
    edge = -graph.adjacency[rows, f]
    assert (np.sign(moved) == np.sign(edge)).all()
    assert np.corrcoef(moved, edge)[0, 1] > 0.8
    with pytest.raises(ReplacementError, match="mode"):
        intervene(local, {}, mode="other")


def test_full_interventions_add_the_decoder_delta_to_the_real_mlps(case):
    """circuit-tracer's feature_intervention: zeroing a feature of the first block at the
    last position adds -a_f W_dec^{0->t}[latent] to every block t it writes, the MLPs
    real: with attention live, the last logits equal the model's with those additions made
    by hand; frozen (the default), the last position's own attention keeps its clean
    pattern, a little apart."""
    local, graph = case
    rm, rep = local.replacement_model, local.replacement
    first = np.flatnonzero((graph.feature_layer == 0) & (graph.feature_pos == graph.n_pos - 1))
    f = int(first[0])
    latent, value, p = int(graph.feature_latent[f]), float(graph.activations[f]), graph.n_pos - 1
    got = intervene(local, {(0, p, latent): 0.0}, mode="full", freeze_attention=False).changed
    handles = []
    for t, module in enumerate(rm._modules):
        if 0 in rep.decoders[t]:
            delta = torch.zeros(graph.n_pos, rep.decoder(0, t).shape[1])
            delta[p] = -value * rep.decoder(0, t)[latent]
            handles.append(module.register_forward_hook(lambda m, a, out, d=delta: out + d))
    try:
        with torch.no_grad():
            want = local.model(input_ids=local.tokens[None]).logits[0, -1]
    finally:
        for h in handles:
            h.remove()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got - local.logits[-1]).abs().max() > 1e-3
    frozen = intervene(local, {(0, p, latent): 0.0}, mode="full").changed
    assert 0 < (frozen - got).abs().max() < 0.1 * (got - local.logits[-1]).abs().max()
    # "replaced" swaps the MLPs for the dictionary's response: another answer
    replaced = intervene(local, {(0, p, latent): 0.0}, mode="replaced").changed
    assert (replaced - got).abs().max() > 1e-4
    with pytest.raises(ReplacementError, match="no feature"):
        intervene(local, {(graph.n_blocks, 0, 0): 0.0}, mode="full")


def test_a_replacement_of_any_dictionary_and_its_refusals(toy, dictionaries, tmp_path):
    from pyspark_safetensors.circuits import load_replacement
    from pyspark_safetensors.sae.checkpoint import save_sae
    from pyspark_safetensors.sae.ecosystem import read_sae

    rm = ReplacementModel.load(toy, dictionaries["per_layer"])
    rep = rm.replacement
    assert load_replacement(rm.model, rep) is rep
    # per-layer transcoders hold no JumpReLU thresholds: the rule is refused, not a ReLU
    with pytest.raises(ReplacementError, match="no JumpReLU thresholds"):
        ReplacementModel.load(toy, dictionaries["per_layer"], rule="threshold")
    clt = ReplacementModel.load(toy, dictionaries["clt"], rule="threshold").replacement
    assert clt.rule == "threshold" and clt.threshold is not None
    with pytest.raises(ReplacementError, match="encodes by topk"):
        load_replacement(rm.model, rep, rule="threshold")
    # a transcoder file that records no hook point must be given its block
    tensors, _ = read_sae(dictionaries["per_layer"][0])
    save_sae(tmp_path / "bare.safetensors", tensors, {"architecture": "transcoder", "k": "4"})
    with pytest.raises(ReplacementError, match="records no hook_point"):
        load_replacement(rm.model, [tmp_path / "bare.safetensors"])
    named = load_replacement(rm.model, {"model.layers.0.mlp": tmp_path / "bare.safetensors"})
    assert named.blocks == ("model.layers.0.mlp",) and rm.layers == [0, 1]
    # a prompt's ids as a graph keeps them (numpy), as docs/graphs.md hands them back
    local = rm.capture(np.asarray(rm.tokenizer("The quick fox")["input_ids"]))
    assert local.tokens.dtype == torch.long and len(local.features) > 0


def _selection_by_hand(graph, limit: int, batch: int, interval: int) -> list[int]:
    """circuit-tracer's partial attribution replayed on a full graph (numpy): the logit
    rows known first; then, until ``limit`` features are attributed, rank the features by
    their influence through the rows known so far and take the next ``interval * batch``
    not yet taken (each taken feature's row then becomes known)."""
    F, K, n = graph.n_features, len(graph.logit_tokens), graph.n_nodes
    known = list(range(graph.logit_start, n))
    taken: list[int] = []
    while len(taken) < limit:
        a = np.abs(graph.adjacency[known].astype(np.float32))
        a /= np.maximum(a.sum(1, keepdims=True), 1e-8)
        prod = np.zeros(n, np.float32)
        prod[-K:] = graph.logit_probabilities
        total = np.zeros(n, np.float32)
        while True:
            prod = prod[known] @ a
            if not prod.any():
                break
            total += prod
        rank = np.argsort(-total[:F], kind="stable")
        fresh = [int(f) for f in rank if f not in taken]
        new = fresh[: min(interval * batch, limit - len(taken))]
        taken += new
        known += new
    return sorted(taken)


@pytest.mark.parametrize("limit", [7, 30])
def test_partial_attribution_takes_the_most_influential_features(case, limit):
    local, full = case
    config = AttributionConfig(batch_size=4, max_feature_nodes=limit, update_interval=2)
    graph = attribute_local(local, config)
    F, Fs = full.n_features, graph.n_features
    assert Fs == limit and graph.n_active == F
    chosen = [int(np.flatnonzero((full.feature_layer == a) & (full.feature_pos == b)
                                 & (full.feature_latent == c))[0])
              for a, b, c in zip(graph.feature_layer, graph.feature_pos, graph.feature_latent,
                                 strict=True)]  # fmt: skip
    assert chosen == _selection_by_hand(full, limit, 4, 2)
    # its rows and columns are the full graph's at its nodes
    nodes = np.r_[chosen, F : full.n_nodes]
    np.testing.assert_allclose(graph.adjacency, full.adjacency[np.ix_(nodes, nodes)],
                               rtol=1e-5, atol=1e-6)  # fmt: skip
    np.testing.assert_allclose(graph.values, full.values[nodes], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(graph.bias, full.bias[nodes], rtol=1e-5, atol=1e-6)
    # every limit at or above the active features is the full graph
    whole = attribute_local(local, AttributionConfig(batch_size=40, max_feature_nodes=F + 5))
    np.testing.assert_array_equal(whole.adjacency, full.adjacency)
