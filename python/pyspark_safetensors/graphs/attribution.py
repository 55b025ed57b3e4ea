"""Attribution of one prompt: the direct effect of every node on every feature and logit
of the prompt's local replacement model (``circuits.local``, the replacement model's
frozen mode).

Nodes, in this order (circuit-tracer's): the active features (sorted by model layer,
position, latent), an error node per (block, position), block-major, the token
embeddings per position, and the output logits of the last position, the most probable
first, until their probabilities sum to ``logit_probability`` or ``max_logits`` are
taken. A feature's value is its pre-activation ``W_enc x + b_enc``, a logit node's its
logit minus the mean logit (``W_U`` columns demeaned, as circuit-tracer does), so the
node is the logit's share of the softmax.

In the frozen model every target is linear in the sources, ``target_j = sum_i A[j, i] +
bias_j``: ``A[j, i]`` (row = target, column = source) is the coefficient of source i
times its value (a feature's activation; 1 for error and embedding nodes, whose scale
is the source), found by a backward pass from the target, ``batch_size`` targets at a
time (each a row of a batched forward); ``bias_j`` is the target with every source at 0
(the transcoders' and encoders' biases through the frozen model). Both are exact to
float tolerance (tests/graphs).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..circuits.local import LocalReplacement
from ..circuits.replacement import ReplacementError
from .graph import AttributionGraph


class AttributionError(ReplacementError):
    """A prompt or setting no graph can be made of."""


@dataclass(frozen=True)
class AttributionConfig:
    """How a prompt's graph is made (circuit-tracer's defaults)."""

    max_logits: int = 10
    """At most this many logit nodes."""
    logit_probability: float = 0.95
    """Logit nodes are taken, most probable first, until their probability sums to this."""
    batch_size: int = 64
    """Targets per backward pass."""
    max_feature_nodes: int = 0
    """Attribute at most this many features, the most influential on the logits first
    (partial attribution); 0: every active feature."""
    update_interval: int = 4
    """Batches attributed between two re-rankings of the features by influence."""

    def __post_init__(self):
        if (self.max_logits < 1 or not 0 < self.logit_probability <= 1 or self.batch_size < 1
                or self.max_feature_nodes < 0 or self.update_interval < 1):  # fmt: skip
            raise AttributionError(
                "max_logits, batch_size and update_interval must be >= 1, max_feature_nodes "
                ">= 0 and logit_probability in (0, 1]"
            )


def salient_logits(logits: torch.Tensor, max_logits: int, probability: float):
    """The top logits of one position up to the probability mass: (ids, probabilities)."""
    probs = torch.softmax(logits.double(), -1)
    top_p, top_i = probs.topk(min(max_logits, len(probs)))
    n = int(torch.searchsorted(top_p.cumsum(0), torch.tensor(probability, dtype=top_p.dtype))) + 1
    return top_i[:n], top_p[:n].float()


def logit_directions(local: LocalReplacement, ids: torch.Tensor) -> torch.Tensor:
    """``W_U`` rows of ``ids`` minus the mean row ``[K, d]``: a logit node's readout."""
    w = local.model.lm_head.weight
    return w[ids] - w.mean(0)


def _targets(local: LocalReplacement, xs, final, idx: torch.Tensor, logit_dirs) -> torch.Tensor:
    """Row b's target ``idx[b]`` (< F: a feature's pre-activation; else a logit node)."""
    feats, F = local.features, len(local.features)
    enc_w, enc_b = local.encoder_rows()
    out = []
    for b, j in enumerate(idx.tolist()):
        if j < F:
            x = xs[int(feats.model_layer[j])][b, int(feats.pos[j])]
            out.append(x @ enc_w[j] + enc_b[j])
        else:
            out.append(final[b] @ logit_dirs[j - F])
    return torch.stack(out)


def edge_rows(local: LocalReplacement, targets: torch.Tensor, logit_dirs) -> torch.Tensor:
    """The adjacency rows ``[len(targets), F + n_blocks P + P]`` of ``targets`` (feature
    indices below F, then F + logit index), by one batched backward pass."""
    B = len(targets)
    values, err, emb = (s.requires_grad_(True) for s in local.clean_sources(B))
    with torch.enable_grad():
        xs, final = local.run(values, err, emb)
        total = _targets(local, xs, final, targets, logit_dirs).sum()
        grads = torch.autograd.grad(total, (values, err, emb), allow_unused=True)
    # a source upstream of no target in the batch gets no gradient: its edges are 0
    g_val, g_err, g_emb = (torch.zeros_like(s) if g is None else g
                           for g, s in zip(grads, (values, err, emb), strict=True))  # fmt: skip
    return torch.cat([g_val * local.features.value, g_err.flatten(1), g_emb], 1).detach()


def constant_terms(local: LocalReplacement, logit_dirs) -> torch.Tensor:
    """Every target with every source at zero ``[F + K]``."""
    values, err, emb = (torch.zeros_like(s) for s in local.clean_sources(1))
    n = len(local.features) + len(logit_dirs)
    with torch.no_grad():
        xs, final = local.run(values, err, emb)
        pre = local.pre_activations(xs)[0]
        return torch.cat([pre, final[0] @ logit_dirs.T]) if n else pre


def attribute_local(local: LocalReplacement, config: AttributionConfig = AttributionConfig(),
                    prompt: str = "") -> AttributionGraph:  # fmt: skip
    """The unpruned graph of a captured prompt."""
    feats, F = local.features, len(local.features)
    ids, probs = salient_logits(local.logits[-1], config.max_logits, config.logit_probability)
    dirs = logit_directions(local, ids)
    n_src = F + local.n_blocks * local.n_pos + local.n_pos
    N = n_src + len(ids)
    adjacency = torch.zeros(N, N)
    all_targets = torch.arange(F + len(ids))
    for lo in range(0, len(all_targets), config.batch_size):
        chunk = all_targets[lo : lo + config.batch_size]
        rows = edge_rows(local, chunk, dirs)
        where = torch.where(chunk < F, chunk, chunk - F + n_src)
        adjacency[where, :n_src] = rows
    bias = torch.zeros(N)
    const = constant_terms(local, dirs)
    bias[:F], bias[n_src:] = const[:F], const[F:]
    with torch.no_grad():
        xs, final = local.run(*local.clean_sources())
        values = torch.zeros(N)
        values[:F] = local.pre_activations(xs)[0]
        values[n_src:] = final[0] @ dirs.T
    return AttributionGraph(
        prompt=prompt,
        tokens=local.tokens.numpy().astype(np.int64),
        feature_layer=feats.model_layer.numpy().astype(np.int32),
        feature_pos=feats.pos.numpy().astype(np.int32),
        feature_latent=feats.latent.numpy().astype(np.int32),
        activations=feats.value.numpy().astype(np.float32),
        n_blocks=local.n_blocks,
        logit_tokens=ids.numpy().astype(np.int64),
        logit_probabilities=probs.numpy().astype(np.float32),
        adjacency=adjacency.numpy(),
        values=values.numpy(),
        bias=bias.numpy(),
    )


def attribute(replacement_model, tokens, config: AttributionConfig = AttributionConfig(),
              prompt: str = "") -> AttributionGraph:  # fmt: skip
    """The unpruned attribution graph of ``tokens`` (``[P]`` ids, BOS included if the
    model wants one) through ``replacement_model`` (``circuits.ReplacementModel``)."""
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    if tokens.ndim != 1 or len(tokens) == 0:
        raise AttributionError("a prompt must be a non-empty 1-D sequence of token ids")
    context = getattr(replacement_model.model.config, "max_position_embeddings", None)
    if context and len(tokens) > context:
        raise AttributionError(f"a prompt of {len(tokens)} tokens exceeds the model's {context}")
    return attribute_local(replacement_model.capture(tokens), config, prompt)
