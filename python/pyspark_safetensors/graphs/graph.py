"""An attribution graph, its pruning and its scores (numpy only).

Influence (circuit-tracer's, Ameisen et al. 2025): ``|A|`` with each target's row
normalised to sum 1 is ``Â``; a node's influence on the output is ``w (Â + Â² + ...)``
where ``w`` holds each logit node's probability (the series ends: the graph is acyclic).

**Pruning** (``prune``): keep the nodes of largest influence that make up
``node_threshold`` of the total (token and logit nodes always kept); in the graph of
those nodes, score each edge by its normalised weight times its target's influence
(plus the target's own logit weight) and keep the largest that make up
``edge_threshold`` of the total; then drop, until nothing changes, feature and error
nodes left without an outgoing edge and feature nodes without an incoming one.

**Scores** (``scores``): the replacement score is the share of the tokens' and errors'
influence that is the tokens' (1: every path from the input to the output goes through
features); the completeness score is the influence-weighted mean, over nodes, of the
share of a node's normalised input that does not come from error nodes (logit nodes
weigh their probability on top of their influence).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..format.errors import InvalidArgumentError


@dataclass
class AttributionGraph:
    """One prompt's graph: node order features, errors (block-major), embeddings, logits;
    ``adjacency[target, source]`` the direct effect."""

    prompt: str
    tokens: np.ndarray  # [P] int64
    feature_layer: np.ndarray  # [F] the model block
    feature_pos: np.ndarray  # [F]
    feature_latent: np.ndarray  # [F]
    activations: np.ndarray  # [F]
    n_blocks: int
    logit_tokens: np.ndarray  # [K]
    logit_probabilities: np.ndarray  # [K]
    adjacency: np.ndarray  # [N, N] float32
    values: np.ndarray  # [N] a feature's pre-activation, a logit node's demeaned logit
    bias: np.ndarray  # [N] a target's constant term (its value with every source at 0)
    n_active: int = -1  # the prompt's active features (-1: as many as the graph holds)

    def __post_init__(self):
        if self.n_active < 0:
            self.n_active = len(self.activations)

    @property
    def n_features(self) -> int:
        return len(self.activations)

    @property
    def n_pos(self) -> int:
        return len(self.tokens)

    @property
    def error_start(self) -> int:
        return self.n_features

    @property
    def token_start(self) -> int:
        return self.n_features + self.n_blocks * self.n_pos

    @property
    def logit_start(self) -> int:
        return self.token_start + self.n_pos

    @property
    def n_nodes(self) -> int:
        return self.logit_start + len(self.logit_tokens)

    def kinds(self) -> np.ndarray:
        """Each node's kind: "feature", "error", "embedding" or "logit"."""
        counts = [self.n_features, self.n_blocks * self.n_pos, self.n_pos, len(self.logit_tokens)]
        return np.repeat(np.array(["feature", "error", "embedding", "logit"]), counts)

    def node_ids(self) -> list[str]:
        """Stable names: ``F{layer}.{latent}@{pos}``, ``E{layer}@{pos}``, ``T{pos}``, ``L{token}``."""
        ids = [f"F{a}.{c}@{b}" for a, b, c in
               zip(self.feature_layer, self.feature_pos, self.feature_latent, strict=True)]  # fmt: skip
        ids += [f"E{b}@{p}" for b in range(self.n_blocks) for p in range(self.n_pos)]
        ids += [f"T{p}" for p in range(self.n_pos)]
        return ids + [f"L{t}" for t in self.logit_tokens]

    def logit_weights(self) -> np.ndarray:
        w = np.zeros(self.n_nodes)
        w[self.logit_start :] = self.logit_probabilities
        return w


def normalized(adjacency: np.ndarray) -> np.ndarray:
    """``|A|`` with each row divided by its sum (rows of zeros stay zero)."""
    a = np.abs(adjacency.astype(np.float64))
    return a / np.maximum(a.sum(1, keepdims=True), 1e-10)


def influence(normalized_adjacency: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """``weights (Â + Â² + ...)``; refuses a cyclic graph."""
    step = weights @ normalized_adjacency
    total = step.copy()
    for _ in range(len(weights) + 1):
        if not step.any():
            return total
        step = step @ normalized_adjacency
        total += step
    raise InvalidArgumentError("the graph's influence does not converge: it has a cycle")


def _cutoff(scores: np.ndarray, share: float) -> float:
    """The score above which the largest scores make up ``share`` of the total."""
    ranked = np.sort(scores.ravel())[::-1]
    total = ranked.sum()
    if total <= 0:
        return np.inf
    i = int(np.searchsorted(np.cumsum(ranked) / total, share))
    return ranked[min(i, len(ranked) - 1)]


@dataclass(frozen=True)
class Pruned:
    """The kept nodes and edges, and each node's cumulative influence share (the share of
    total influence of the nodes at least as influential)."""

    node_mask: np.ndarray  # [N] bool
    edge_mask: np.ndarray  # [N, N] bool
    cumulative: np.ndarray  # [N]


def prune(
    graph: AttributionGraph, node_threshold: float = 0.8, edge_threshold: float = 0.98
) -> Pruned:
    """The graph pruned by cumulative influence (module docstring)."""
    for name, v in (("node_threshold", node_threshold), ("edge_threshold", edge_threshold)):
        if not 0.0 <= v <= 1.0:
            raise InvalidArgumentError(f"{name} must be in [0, 1], got {v}")
    w = graph.logit_weights()
    node_inf = influence(normalized(graph.adjacency), w)
    keep = node_inf >= _cutoff(node_inf, node_threshold)
    keep[graph.token_start :] = True
    a = np.where(keep[:, None] & keep[None, :], graph.adjacency, 0.0)
    norm = normalized(a)
    edge_scores = norm * (influence(norm, w) + w)[:, None]
    edges = edge_scores >= _cutoff(edge_scores, edge_threshold)
    edges &= edge_scores > 0
    inner, F = slice(0, graph.token_start), graph.n_features
    while True:
        before = keep.copy()
        edges &= keep[:, None] & keep[None, :]
        keep[inner] &= edges[:, inner].any(0)  # features and errors: an outgoing edge
        keep[:F] &= edges[:F].any(1)  # features: an incoming edge
        if (keep == before).all():
            break
    order = np.argsort(-node_inf, kind="stable")
    cumulative = np.empty_like(node_inf)
    total = node_inf.sum()
    cumulative[order] = np.cumsum(node_inf[order]) / (total if total > 0 else 1.0)
    return Pruned(keep, edges, cumulative)


def scores(graph: AttributionGraph) -> tuple[float, float]:
    """(replacement score, completeness score) of the unpruned graph (module docstring)."""
    w = graph.logit_weights()
    norm = normalized(graph.adjacency)
    inf = influence(norm, w)
    errors = slice(graph.error_start, graph.token_start)
    token_inf = inf[graph.token_start : graph.logit_start].sum()
    error_inf = inf[errors].sum()
    replacement = token_inf / (token_inf + error_inf) if token_inf + error_inf > 0 else 0.0
    non_error = 1.0 - norm[:, errors].sum(1)
    out = inf + w
    completeness = (non_error * out).sum() / out.sum() if out.sum() > 0 else 0.0
    return float(replacement), float(completeness)
