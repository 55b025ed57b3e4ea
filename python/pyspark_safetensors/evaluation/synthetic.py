"""A synthetic activation model with known features, as SAELens' SynthSAEBench defines it
(sae-lens 6.54, ``sae_lens.synthetic``), written here from its definition so that no
optional install is needed, and stored in its on-disk layout so that either library
loads the other's.

A sample is ``x = a W + b`` (``W [F, H]``: one unit-norm direction per true feature; ``b``:
a bias of norm ``bias``) where the feature activations ``a [F]`` are drawn as follows:

1. which features fire: each feature ``i`` with probability ``p_i`` (``firing_probability``:
   Zipfian, linear, random or constant over the features), independently, or through a
   Gaussian copula of a low-rank correlation ``C = U U^T + diag(1 - |U_i|^2)``
   (``correlation``): feature ``i`` fires where ``g_i > Phi^-1(1 - p_i)``, ``g ~ N(0, C)``,
   which keeps each ``p_i``;
2. how strongly: ``relu(mean_i + std_i * N(0, 1))`` (``mean_firing_magnitudes``,
   ``std_firing_magnitudes``: a constant or a per-feature profile);
3. the hierarchy (``hierarchy``): a forest of features, built breadth-first, whose children
   are silenced where their parent is silent, level by level, and where a parent's children
   are mutually exclusive, one of those that fire is kept, chosen uniformly at random
   (children may instead be scaled by ``parent / mean_parent``); with
   ``compensate_probabilities`` the ``p_i`` are raised first so that each feature's
   effective rate stays about ``p_i``.

The directions start as Gaussian unit vectors and, with ``orthogonalization``, are pushed
apart by Adam on the off-diagonal Gram entries (their dimension is smaller than their
number, so they stay in superposition). Every random draw of the model's construction
follows SAELens' order and seeds (the hierarchy from ``seed + 3``, the correlation factor
from ``seed + 4``, the directions and bias from ``seed``, the folded-normal magnitude
profiles from ``seed + 1`` and ``seed + 2``), so the same configuration builds the same
model in both (``tests/evaluation/test_synthetic.py`` checks it where sae-lens installs).
Samples are drawn from a ``torch.Generator`` the caller seeds (``sample``): the Spark job
seeds one per partition from ``(seed, partition)`` (``job.py``).

One deviation: SAELens' ``seed`` defaults to None (a fresh model each time); here it is 0,
so that a configuration names one model.
"""

from __future__ import annotations

import json
import math
import os
import random
from collections import deque
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import ClassVar, Literal

import numpy as np
import torch

from ..format.errors import InvalidArgumentError

#: SAELens' file names (``sae_lens.synthetic.synthetic_model``).
CONFIG_FILE = "synthetic_model_config.json"
WEIGHTS_FILE = "synthetic_model.safetensors"
HIERARCHY_FILE = "hierarchy.json"

#: Floor of the low-rank correlation's diagonal (SAELens' ``_MIN_DIAG``): rows of the
#: factor whose squared norm would leave less are rescaled.
MIN_CORRELATION_DIAG = 0.01


# --- firing probabilities --------------------------------------------------------------


@dataclass(frozen=True)
class ZipfianFiring:
    """``p_r ∝ 1 / r^exponent`` over the ranks r = 1..F, rescaled to [min_prob, max_prob]
    (descending: feature 0 fires most)."""

    exponent: float = 1.0
    """Zipf exponent (higher: a steeper drop)."""
    max_prob: float = 0.3
    """Probability of the most frequent feature."""
    min_prob: float = 0.01
    """Probability of the least frequent feature."""
    NAME: ClassVar[str] = "zipfian"

    def __post_init__(self):
        if self.exponent <= 0:
            raise InvalidArgumentError("zipfian exponent must be positive")
        if not 0 < self.min_prob < self.max_prob <= 1:
            raise InvalidArgumentError("zipfian firing needs 0 < min_prob < max_prob <= 1")

    def generate(self, n: int, seed: int) -> torch.Tensor:
        if n == 1:
            return torch.tensor([self.max_prob])
        probs = 1.0 / torch.arange(1, n + 1, dtype=torch.float32) ** self.exponent
        lo, hi = probs.min(), probs.max()
        return self.min_prob + (self.max_prob - self.min_prob) * (probs - lo) / (hi - lo)


@dataclass(frozen=True)
class LinearFiring:
    """Probabilities decaying linearly from max_prob (feature 0) to min_prob."""

    max_prob: float = 0.3
    min_prob: float = 0.01
    NAME: ClassVar[str] = "linear"

    def __post_init__(self):
        if not 0 < self.min_prob <= self.max_prob <= 1:
            raise InvalidArgumentError("linear firing needs 0 < min_prob <= max_prob <= 1")

    def generate(self, n: int, seed: int) -> torch.Tensor:
        if n == 1:
            return torch.tensor([self.max_prob])
        return torch.linspace(self.max_prob, self.min_prob, n)


@dataclass(frozen=True)
class RandomFiring:
    """Probabilities drawn uniformly from [min_prob, max_prob] (from the model's seed)."""

    max_prob: float = 0.5
    min_prob: float = 0.01
    NAME: ClassVar[str] = "random"

    def __post_init__(self):
        if not 0 < self.min_prob < self.max_prob <= 1:
            raise InvalidArgumentError("random firing needs 0 < min_prob < max_prob <= 1")

    def generate(self, n: int, seed: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        u = torch.rand(n, generator=gen, dtype=torch.float32)
        return self.min_prob + (self.max_prob - self.min_prob) * u


@dataclass(frozen=True)
class ConstantFiring:
    """Every feature fires with ``probability``."""

    probability: float = 0.1
    NAME: ClassVar[str] = "constant"

    def generate(self, n: int, seed: int) -> torch.Tensor:
        return torch.full((n,), self.probability, dtype=torch.float32)


FiringProbability = ZipfianFiring | LinearFiring | RandomFiring | ConstantFiring
_FIRING = {c.NAME: c for c in (ZipfianFiring, LinearFiring, RandomFiring, ConstantFiring)}


# --- firing magnitudes -----------------------------------------------------------------


@dataclass(frozen=True)
class LinearMagnitude:
    """Per-feature values from ``start`` (feature 0) to ``end``, linearly."""

    start: float
    end: float
    NAME: ClassVar[str] = "linear"

    def __post_init__(self):
        if self.start <= 0 or self.end <= 0:
            raise InvalidArgumentError("linear magnitudes need positive start and end")

    def generate(self, n: int, seed: int) -> torch.Tensor:
        return torch.tensor([self.start]) if n == 1 else torch.linspace(self.start, self.end, n)


@dataclass(frozen=True)
class ExponentialMagnitude:
    """Per-feature values ``start * (end / start)^(i / (n - 1))``."""

    start: float
    end: float
    NAME: ClassVar[str] = "exponential"

    def __post_init__(self):
        if self.start <= 0 or self.end <= 0:
            raise InvalidArgumentError("exponential magnitudes need positive start and end")

    def generate(self, n: int, seed: int) -> torch.Tensor:
        if n == 1:
            return torch.tensor([self.start])
        return self.start * (self.end / self.start) ** torch.linspace(0, 1, n)


@dataclass(frozen=True)
class FoldedNormalMagnitude:
    """Per-feature values ``|N(mean, std^2)|``, clamped to [min_value, max_value]."""

    mean: float = 0.0
    std: float = 0.1
    min_value: float | None = None
    max_value: float | None = None
    NAME: ClassVar[str] = "folded_normal"

    def __post_init__(self):
        if self.std <= 0:
            raise InvalidArgumentError("folded_normal magnitudes need a positive std")

    def generate(self, n: int, seed: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        out = (self.mean + torch.randn(n, generator=gen) * self.std).abs()
        if self.min_value is not None or self.max_value is not None:
            out = out.clamp(min=self.min_value, max=self.max_value)
        return out


Magnitude = float | LinearMagnitude | ExponentialMagnitude | FoldedNormalMagnitude
_MAGNITUDES = {c.NAME: c for c in (LinearMagnitude, ExponentialMagnitude, FoldedNormalMagnitude)}


def _magnitudes(n: int, value: Magnitude, seed: int) -> torch.Tensor:
    if isinstance(value, int | float):
        return torch.full((n,), float(value), dtype=torch.float32)
    return value.generate(n, seed).to(torch.float32)


# --- structure -------------------------------------------------------------------------


@dataclass(frozen=True)
class HierarchyConfig:
    """A forest of features (SAELens' ``HierarchyConfig``): ``total_root_nodes`` trees
    built breadth-first over the features in index order, each parent with
    ``branching_factor`` children, down to ``max_depth``."""

    total_root_nodes: int = 100
    """Number of trees (their roots are features 0..total_root_nodes-1)."""
    branching_factor: int | tuple[int, int] = 100
    """Children per parent, or a (min, max) range drawn per parent."""
    max_depth: int = 2
    """Depth of the trees (1: roots with leaves)."""
    mutually_exclusive_portion: float = 0.0
    """Fraction of eligible parents whose children fire one at a time."""
    mutually_exclusive_min_depth: int = 0
    """Shallowest parent depth (0: roots) whose children may be exclusive."""
    mutually_exclusive_max_depth: int | None = None
    """Deepest such parent depth (None: no limit)."""
    compensate_probabilities: bool = False
    """Raise the children's probabilities so their effective rates stay about p_i."""
    scale_children_by_parent: bool = False
    """Scale children by parent / mean_parent instead of gating them."""

    def __post_init__(self):
        if self.total_root_nodes <= 0:
            raise InvalidArgumentError("hierarchy total_root_nodes must be positive")
        b = self.branching_factor
        lo, hi = (b, b) if isinstance(b, int) else tuple(b)
        if lo < 2 or lo > hi:
            raise InvalidArgumentError("hierarchy branching_factor must be >= 2 (min <= max)")
        if self.max_depth < 1:
            raise InvalidArgumentError("hierarchy max_depth must be at least 1")
        if not 0.0 <= self.mutually_exclusive_portion <= 1.0:
            raise InvalidArgumentError("mutually_exclusive_portion must be in [0, 1]")


@dataclass(frozen=True)
class OrthogonalizationConfig:
    """Adam steps pushing the feature directions apart (SAELens' defaults)."""

    num_steps: int = 200
    lr: float = 0.01
    chunk_size: int = 1024
    """Directions per block of the Gram matrix (memory: chunk_size x F)."""


@dataclass(frozen=True)
class LowRankCorrelationConfig:
    """A low-rank correlation of the firings: factor ``U [F, rank] ~ N(0, scale^2)``."""

    rank: int = 32
    correlation_scale: float = 0.1
    seed: int | None = None
    """Kept for SAELens' file; the factor is drawn from the model's ``seed + 4``."""

    def __post_init__(self):
        if self.rank <= 0 or self.correlation_scale < 0:
            raise InvalidArgumentError("correlation rank must be > 0 and its scale >= 0")


@dataclass(frozen=True)
class SyntheticModelConfig:
    """A synthetic model (module docstring); the defaults are SAELens' ``SyntheticModelConfig``
    ones, except ``seed`` (0, not None)."""

    num_features: int
    """Number of true features F."""
    hidden_dim: int
    """Width H of the activations."""
    firing_probability: FiringProbability = field(default_factory=ZipfianFiring)
    """How often each feature fires."""
    hierarchy: HierarchyConfig | None = None
    orthogonalization: OrthogonalizationConfig | None = None
    correlation: LowRankCorrelationConfig | None = None
    std_firing_magnitudes: Magnitude = 0.0
    """Standard deviation of a firing's magnitude (0: every firing is mean)."""
    mean_firing_magnitudes: Magnitude = 1.0
    """Mean magnitude of a firing."""
    bias: bool | float = 1.0
    """The activations' offset: False none, True norm 1, a float that norm."""
    dtype: Literal["float32"] = "float32"
    seed: int = 0
    """Seed of the model's construction (not of its samples)."""

    def __post_init__(self):
        if self.num_features < 1 or self.hidden_dim < 1:
            raise InvalidArgumentError("num_features and hidden_dim must be at least 1")

    def to_dict(self) -> dict:
        """SAELens' JSON form (``SyntheticModelConfig.to_dict``)."""

        def tagged(value):
            return value if isinstance(value, int | float) else asdict(value) | {
                "generator_name": value.NAME}  # fmt: skip

        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["firing_probability"] = tagged(self.firing_probability)
        for name in ("std_firing_magnitudes", "mean_firing_magnitudes"):
            out[name] = tagged(out[name])
        for name in ("hierarchy", "orthogonalization", "correlation"):
            value = getattr(self, name)
            out[name] = None if value is None else asdict(value)
        if self.hierarchy is not None and not isinstance(self.hierarchy.branching_factor, int):
            out["hierarchy"]["branching_factor"] = list(self.hierarchy.branching_factor)
        return out

    @classmethod
    def from_dict(cls, d: dict) -> SyntheticModelConfig:
        """From SAELens' JSON form (ours or its own ``synthetic_model_config.json``)."""
        d = dict(d)

        def untag(value, table):
            if not isinstance(value, dict):
                return float(value)
            value = dict(value)
            name = value.pop("generator_name", None)
            if name not in table:
                raise InvalidArgumentError(f"unknown generator_name {name!r}: {sorted(table)}")
            return table[name](**value)

        d["firing_probability"] = untag(d.get("firing_probability", {"generator_name":
                                                                      "zipfian"}), _FIRING)  # fmt: skip
        for name in ("std_firing_magnitudes", "mean_firing_magnitudes"):
            if name in d:
                d[name] = untag(d[name], _MAGNITUDES)
        if d.get("hierarchy") is not None:
            h = dict(d["hierarchy"])
            if isinstance(h.get("branching_factor"), list):
                h["branching_factor"] = tuple(h["branching_factor"])
            d["hierarchy"] = HierarchyConfig(**h)
        for name, kind in (("orthogonalization", OrthogonalizationConfig),
                           ("correlation", LowRankCorrelationConfig)):  # fmt: skip
            if d.get(name) is not None:
                d[name] = kind(**d[name])
        if d.get("seed") is None:
            d["seed"] = 0
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


# --- the hierarchy ---------------------------------------------------------------------


@dataclass
class Node:
    """One node of a hierarchy tree (SAELens' ``HierarchyNode``; ``feature`` None: a node
    that groups its children without a feature of its own)."""

    feature: int | None
    children: list[Node] = field(default_factory=list)
    exclusive: bool = False
    rescale: bool = False

    def to_dict(self) -> dict:
        return {"feature_index": self.feature, "mutually_exclusive_children": self.exclusive,
                "scale_children_by_parent": self.rescale, "feature_id": None,
                "children": [c.to_dict() for c in self.children]}  # fmt: skip

    @classmethod
    def from_dict(cls, d: dict) -> Node:
        return cls(d.get("feature_index"), [cls.from_dict(c) for c in d.get("children", [])],
                   bool(d.get("mutually_exclusive_children")),
                   bool(d.get("scale_children_by_parent")))  # fmt: skip


def generate_hierarchy(num_features: int, config: HierarchyConfig, seed: int) -> list[Node]:
    """The forest of ``config`` over features 0.. in breadth-first order, with SAELens'
    draws (``random.Random(seed)``: a branching per parent when it is a range, then the
    exclusive parents)."""
    rng = random.Random(seed)
    counter = iter(range(num_features))
    roots: list[Node] = []
    parents: list[tuple[Node, int]] = []
    for _ in range(config.total_root_nodes):
        feature = next(counter, None)
        if feature is None:
            break
        roots.append(Node(feature))
        parents.append((roots[-1], 0))
    level = [(r, 0) for r in roots]
    while level:
        following = []
        for parent, depth in level:
            if depth >= config.max_depth:
                continue
            b = config.branching_factor
            branching = b if isinstance(b, int) else rng.randint(b[0], b[1])
            children = []
            for _ in range(branching):
                feature = next(counter, None)
                if feature is None:
                    break
                child = Node(feature)
                if depth + 1 < config.max_depth:
                    following.append((child, depth + 1))
                    parents.append((child, depth + 1))
                children.append(child)
            parent.children = children
        level = following
    hi = config.mutually_exclusive_max_depth
    eligible = [node for node, depth in parents
                if depth >= config.mutually_exclusive_min_depth
                and (hi is None or depth <= hi) and len(node.children) >= 2]  # fmt: skip
    n_exclusive = int(len(eligible) * config.mutually_exclusive_portion)
    if n_exclusive > 0:
        for i in rng.sample(range(len(eligible)), n_exclusive):
            eligible[i].exclusive = True
    if config.scale_children_by_parent:
        for node, _ in parents:
            node.rescale = True
    return roots


@dataclass
class _Level:
    features: torch.Tensor  # [n] features at this level that have a parent feature
    parents: torch.Tensor  # [n] their parents
    rescale: torch.Tensor  # [n] bool: scaled by the parent instead of gated
    groups: list[tuple[int, torch.Tensor]]  # exclusive groups of this level: (parent, children)


def compile_hierarchy(roots: list[Node], num_features: int) -> tuple[list[_Level], np.ndarray]:
    """The forest as levels applied in order (SAELens' ``_build_sparse_hierarchy``: a
    level's gating, then the exclusive groups whose parent is at that level), and
    ``parent_of [F]`` (each feature's parent feature, -1 for none)."""
    info: dict[int, list[tuple[int, int, bool]]] = {}
    groups: dict[int, list[tuple[int, torch.Tensor]]] = {}
    parent_of = np.full(num_features, -1, dtype=np.int64)
    seen: set[int] = set()
    queue = deque((root, -1, 0, False) for root in roots)
    while queue:
        node, parent, level, rescale = queue.popleft()
        if node.feature is not None:
            if node.feature in seen or not 0 <= node.feature < num_features:
                raise InvalidArgumentError(
                    f"hierarchy: feature {node.feature} appears twice or is outside 0..{num_features - 1}"
                )
            seen.add(node.feature)
            info.setdefault(level, []).append((node.feature, parent, rescale))
            parent_of[node.feature] = parent
        below = node.feature if node.feature is not None else parent
        children = [c.feature for c in node.children if c.feature is not None]
        if node.exclusive and len(children) >= 2:
            owner = node.feature if node.feature is not None else -1
            groups.setdefault(level, []).append((owner, torch.tensor(children)))
        for child in node.children:
            queue.append((child, below, level + 1, node.rescale))
    levels = []
    for level in range(max([*info, *groups], default=-1) + 1):
        rows = [(f, p, r) for f, p, r in info.get(level, []) if p >= 0]
        levels.append(_Level(
            torch.tensor([f for f, _, _ in rows], dtype=torch.long),
            torch.tensor([p for _, p, _ in rows], dtype=torch.long),
            torch.tensor([r for _, _, r in rows], dtype=torch.bool),
            groups.get(level, []),
        ))  # fmt: skip
    return levels, parent_of


def correction_factors(roots: list[Node], probs: torch.Tensor) -> torch.Tensor:
    """SAELens' ``compute_probability_correction_factors``: ``1 / p_parent`` for a child,
    times ``1 + sum(p_siblings) / p_parent`` in an exclusive group."""
    out = torch.ones_like(probs)

    def visit(node: Node, parent_prob: float) -> None:
        if node.feature is not None:
            if parent_prob > 0:
                out[node.feature] = 1.0 / parent_prob
            prob = probs[node.feature].item()
        else:
            prob = parent_prob
        for child in node.children:
            visit(child, prob)
        kids = [
            (c.feature, probs[c.feature].item()) for c in node.children if c.feature is not None
        ]
        if node.exclusive and len(kids) >= 2 and prob > 0:
            total = sum(p for _, p in kids)
            for feature, p in kids:
                out[feature] *= 1.0 + max(0.0, total - p) / prob

    for root in roots:
        visit(root, 1.0)
    return out


# --- the model -------------------------------------------------------------------------


def orthogonalize(vectors: torch.Tensor, config: OrthogonalizationConfig) -> torch.Tensor:
    """SAELens' ``orthogonalize_embeddings``: Adam on ``sum_{i != j} (v_i . v_j)^2 + F sum_i
    (|v_i|^2 - 1)^2``, one Gram block of ``chunk_size`` rows at a time, then unit norm."""
    n = vectors.shape[0]
    emb = vectors.detach().clone()
    emb = (emb / emb.norm(p=2, dim=1, keepdim=True).clamp(min=1e-8)).requires_grad_(True)
    opt = torch.optim.Adam([emb], lr=config.lr)
    with torch.enable_grad():
        for _ in range(config.num_steps):
            opt.zero_grad()
            for i in range(0, n, config.chunk_size):
                end = min(i + config.chunk_size, n)
                dots = emb[i:end] @ emb.T
                rows = torch.arange(end - i)
                off = torch.ones_like(dots, dtype=torch.bool)
                off[rows, i + rows] = False
                diag = dots[rows, i + rows]
                (dots[off].pow(2).sum() + n * (diag - 1).pow(2).sum()).backward()
            opt.step()
    with torch.no_grad():
        return (emb / emb.norm(p=2, dim=1, keepdim=True).clamp(min=1e-8)).detach().clone()


class SyntheticModel:
    """A built synthetic model: ``feature_vectors [F, H]`` (unit rows), ``bias [H]``,
    ``firing_probabilities [F]`` (after the hierarchy's compensation), the magnitudes'
    ``mean``/``std [F]``, the correlation's ``factor [F, r]`` and ``diag [F]`` (or None)
    and the hierarchy's ``roots``. ``build`` makes one from a config, ``load`` reads one
    (ours or SAELens'), ``save`` writes SAELens' layout; ``sample`` draws from it."""

    def __init__(self, config: SyntheticModelConfig, feature_vectors: torch.Tensor,
                 bias: torch.Tensor, firing_probabilities: torch.Tensor,
                 roots: list[Node] | None = None,
                 correlation: tuple[torch.Tensor, torch.Tensor] | None = None):  # fmt: skip
        self.config = config
        self.feature_vectors = feature_vectors.float()
        self.bias = bias.float()
        self.firing_probabilities = firing_probabilities.float()
        seed = config.seed
        self.std = _magnitudes(config.num_features, config.std_firing_magnitudes, seed + 1)
        self.mean = _magnitudes(config.num_features, config.mean_firing_magnitudes, seed + 2)
        self.roots = roots or []
        self.levels, self.parent_of = compile_hierarchy(self.roots, config.num_features)
        self.correlation = correlation
        scaling = torch.cat([lv.parents[lv.rescale] for lv in self.levels] or [torch.empty(0)])
        if not bool((self.mean[scaling.long()] > 0).all()):
            raise InvalidArgumentError(
                "scale_children_by_parent needs parents' mean magnitudes > 0"
            )
        # Phi^-1(1 - p): a feature fires where its Gaussian exceeds it
        self.thresholds = math.sqrt(2) * torch.erfinv(1 - 2 * self.firing_probabilities)

    @property
    def num_features(self) -> int:
        return self.config.num_features

    @property
    def hidden_dim(self) -> int:
        return self.config.hidden_dim

    @classmethod
    def build(cls, config: SyntheticModelConfig) -> SyntheticModel:
        """The model of ``config``, every draw as SAELens makes it (module docstring)."""
        f, h, seed = config.num_features, config.hidden_dim, config.seed
        roots = generate_hierarchy(f, config.hierarchy, seed + 3) if config.hierarchy else []
        correlation = None
        if config.correlation is not None:
            gen = torch.Generator().manual_seed(seed + 4)
            factor = torch.randn(f, config.correlation.rank, generator=gen)
            factor = factor * config.correlation.correlation_scale
            sq = (factor**2).sum(dim=1)
            capped = (1 - sq) < MIN_CORRELATION_DIAG
            factor[capped, :] *= torch.sqrt((1 - MIN_CORRELATION_DIAG) / sq[capped].unsqueeze(1))
            correlation = (factor, 1 - (factor**2).sum(dim=1))
        gen = torch.Generator().manual_seed(seed)
        vectors = torch.randn(f, h, generator=gen)
        vectors = vectors / vectors.norm(p=2, dim=1, keepdim=True).clamp(min=1e-8)
        if config.bias:
            norm = 1.0 if config.bias is True else float(config.bias)
            bias = torch.randn(h, generator=gen)
            bias = bias / bias.norm().clamp(min=1e-8) * norm
        else:
            bias = torch.zeros(h)
        if config.orthogonalization is not None:
            vectors = orthogonalize(vectors, config.orthogonalization)
        probs = config.firing_probability.generate(f, seed).float()
        if roots and config.hierarchy.compensate_probabilities:
            probs = (probs * correction_factors(roots, probs)).clamp(max=1.0)
        return cls(config, vectors, bias, probs, roots, correlation)

    # --- files: SAELens' layout ----------------------------------------------------------

    def save(self, directory: str | os.PathLike) -> Path:
        """Write ``synthetic_model_config.json``, ``synthetic_model.safetensors`` and (with
        a hierarchy) ``hierarchy.json``: SAELens' ``SyntheticModel.load_from_disk`` loads
        it; written whole or not at all."""
        from ..dataset.publish import publishing
        from ..format import write_shard

        weights = {"feature_vectors": self.feature_vectors, "bias": self.bias,
                   "firing_probabilities": self.firing_probabilities}  # fmt: skip
        if self.correlation is not None:
            weights["correlation_factor"], weights["correlation_diag"] = self.correlation
        out = Path(directory)
        with publishing(out) as tmp:
            (tmp / CONFIG_FILE).write_text(json.dumps(self.config.to_dict(), indent=2) + "\n")
            arrays = {k: np.ascontiguousarray(v.numpy()) for k, v in weights.items()}
            write_shard(tmp / WEIGHTS_FILE, arrays, {"format": "pt"})
            if self.roots:
                tree = {"roots": [r.to_dict() for r in self.roots]}
                (tmp / HIERARCHY_FILE).write_text(json.dumps(tree) + "\n")
        return out

    @classmethod
    def load(cls, directory: str | os.PathLike) -> SyntheticModel:
        """A model ``save`` wrote, or one SAELens saved (``SyntheticModel.save``)."""
        from ..format import SafetensorsFile

        path = Path(directory)
        if not (path / CONFIG_FILE).is_file() or not (path / WEIGHTS_FILE).is_file():
            raise InvalidArgumentError(
                f"{path}: not a synthetic model (no {CONFIG_FILE} and {WEIGHTS_FILE})"
            )
        config = SyntheticModelConfig.from_dict(json.loads((path / CONFIG_FILE).read_text()))
        with SafetensorsFile(path / WEIGHTS_FILE) as f:
            w = {n: torch.from_numpy(np.array(f.tensor(n), dtype=np.float32)) for n in f}
        roots = []
        if (path / HIERARCHY_FILE).is_file():
            tree = json.loads((path / HIERARCHY_FILE).read_text())
            roots = [Node.from_dict(r) for r in tree["roots"]]
        correlation = None
        if "correlation_factor" in w:
            correlation = (w["correlation_factor"], w["correlation_diag"])
        return cls(config, w["feature_vectors"], w["bias"], w["firing_probabilities"], roots,
                   correlation)  # fmt: skip

    # --- samples -------------------------------------------------------------------------

    @torch.no_grad()
    def sample_features(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """``[n, F]`` feature activations (module docstring, steps 1-3), every draw from
        ``generator``. Memory: a few ``[n, F]`` float tensors (the caller bounds ``n``)."""
        f = self.num_features
        if self.correlation is not None:
            factor, diag = self.correlation
            eps = torch.randn(n, factor.shape[1], generator=generator)
            eta = torch.randn(n, f, generator=generator)
            fire = (eps @ factor.T + eta * diag.sqrt()) > self.thresholds
        else:
            fire = torch.bernoulli(self.firing_probabilities.expand(n, f), generator=generator)
            fire = fire.bool()
        rows, cols = fire.nonzero(as_tuple=True)
        deltas = torch.randn(len(cols), generator=generator) * self.std[cols]
        acts = torch.zeros(n, f)
        acts[rows, cols] = (self.mean[cols] + deltas).relu()
        if self.levels:
            acts = self._apply_hierarchy(acts, generator).relu()
        return acts

    def _apply_hierarchy(self, acts: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        for level in self.levels:
            if level.features.numel():
                parent = acts[:, level.parents]
                gate = (parent > 0).to(acts.dtype)
                if bool(level.rescale.any()):
                    scale = torch.where(parent > 0, parent / self.mean[level.parents], 0.0)
                    gate = torch.where(level.rescale, scale, gate)
                acts[:, level.features] = acts[:, level.features] * gate
            for owner, children in level.groups:
                active = acts[:, children] > 0
                if owner >= 0:
                    active &= (acts[:, owner] > 0)[:, None]
                clash = active.sum(1) > 1
                if not bool(clash.any()):
                    continue
                scores = torch.rand(int(clash.sum()), len(children), generator=generator)
                scores[~active[clash]] = -1.0
                keep = torch.zeros_like(scores, dtype=torch.bool)
                keep.scatter_(1, scores.argmax(1, keepdim=True), True)
                lose_rows, lose_cols = (active[clash] & ~keep).nonzero(as_tuple=True)
                acts[clash.nonzero()[:, 0][lose_rows], children[lose_cols]] = 0
        return acts

    def hidden(self, acts: torch.Tensor) -> torch.Tensor:
        """``acts [n, F] W + b``: the activations an SAE sees."""
        return acts @ self.feature_vectors + self.bias

    def sample(self, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """``(hidden [n, H], feature activations [n, F])``."""
        acts = self.sample_features(n, generator)
        return self.hidden(acts), acts

    def expected_l0(self) -> float:
        """An upper bound of the mean number of active features per sample: the sum of
        the firing probabilities (the hierarchy only silences)."""
        return float(self.firing_probabilities.sum())
