"""Attribution of one prompt: the direct effect of every node on every feature and logit
of the prompt's local replacement model (``circuits.local``, the replacement model's
frozen mode).

Nodes, in this order (circuit-tracer's): the attributed features (sorted by model layer,
position, latent), an error node per (block, position), block-major, the token
embeddings per position, and the output logits of the last position, the most probable
first, until their probabilities sum to ``logit_probability`` or ``max_logits`` are
taken. A feature's value is its pre-activation ``W_enc x + b_enc``, a logit node's its
logit minus the mean logit (``W_U`` columns demeaned, as circuit-tracer does), so the
node is the logit's share of the softmax.

In the frozen model every target is linear in the sources, ``target_j = sum_i A[j, i] +
bias_j``: ``A[j, i]`` (row = target, column = source) is the coefficient of source i
times its value (a feature's activation; 1 for error and embedding nodes, whose scale
is the source). A row is found by a backward pass from its target, ``batch_size``
targets at a time, through the frozen model's linear part (run forward once): the
target's gradient at each block's output meets what each source writes there (a
feature's decoder rows times its activation, an error's vector, a token's embedding).
``bias_j`` is the target with every source at 0 (the dictionaries' biases through the
frozen model). Both are exact to float tolerance (tests/graphs).

**Partial attribution** (``max_feature_nodes``, circuit-tracer's definition): the logit
rows first; then the features ranked by their influence on the logits through the rows
known so far (``influences``), the next ``update_interval * batch_size`` not yet taken
attributed batch by batch, re-ranked, until ``max_feature_nodes`` are. The graph keeps
those features and every error, token and logit node; edges from the features left out
are dropped (their effect is in no node). Memory per prompt, in float32 words, with F
active features, L blocks, P positions, K logit nodes, M = min(max_feature_nodes, F):
the rows ``(M + K) (F + (L + 1) P)`` while attributing, then the graph's adjacency
``(M + (L + 1) P + K)^2``; the retained forward is ``batch_size`` copies of the
residual stream per block.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm

from ..circuits.local import Features, LocalReplacement
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
    first_position: bool = False
    """Position 0's features and errors are nodes. Off (circuit-tracer's convention):
    position 0, BOS and the attention sink, has none, and what its MLPs write is part of
    every target's constant term."""

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


CACHED_WORDS = 1 << 26
"""Float32 words of decoder rows a prompt's attribution gathers once and keeps (256 MiB);
beyond them a source layer's rows are gathered per batch."""


class _Rows:
    """The adjacency rows of a prompt's targets: a backward pass per batch of targets
    through the frozen model's linear part (run forward once), each target's gradient at
    every block output dotted with what each source writes there (circuit-tracer's
    contraction: a feature's decoder rows into each block times its activation, an error
    node's vector, a token's embedding)."""

    def __init__(self, local: LocalReplacement, batch: int, logit_dirs: torch.Tensor):
        self.local, self.logit_dirs, self.batch = local, logit_dirs, batch
        self.enc_w = local.encoder_rows()[0]
        self.forward = local.gradients(batch)
        feats, rep = local.features, local.replacement
        # per replacement layer s: its features in slots of m, each slot one position's
        # (a position with more features has more slots), so that a block's gradient
        # meets their decoder rows in one batched product with little padding
        self.slots = {}
        for s in feats.layer.unique().tolist():
            idx = (feats.layer == s).nonzero()[:, 0]
            pos = feats.pos[idx]
            counts = torch.bincount(pos, minlength=local.n_pos)
            m = -(-len(idx) // int((counts > 0).sum()))  # the mean count per position
            rank = torch.arange(len(idx)) - (torch.cumsum(counts, 0) - counts)[pos]
            per_pos = -(-counts // m)
            first = torch.cumsum(per_pos, 0) - per_pos
            slot = first[pos] + rank // m
            pad = torch.full((int(per_pos.sum()), m), -1, dtype=torch.long)
            pad[slot, rank % m] = idx
            self.slots[s] = (pad, torch.repeat_interleave(torch.arange(local.n_pos), per_pos))
        # each source layer's decoder rows into each block it writes, per slot ``[slots,
        # d, m]``, gathered once while they fit in CACHED_WORDS, else per batch
        self.writes, left = {}, CACHED_WORDS
        for s, (pad, _) in self.slots.items():
            latents = feats.latent[pad.clamp_min(0)]
            self.writes[s] = []
            for t in range(rep.n_layers):
                if s in rep.sources(t):
                    decoder = rep.decoder(s, t)
                    if pad.numel() * decoder.shape[1] <= left:
                        left -= pad.numel() * decoder.shape[1]
                        decoder = decoder[latents].transpose(1, 2).contiguous()
                    self.writes[s].append((self.local.block_of_layer[t], decoder))

    @property
    def width(self) -> int:
        """Sources: features, errors (block-major), embeddings."""
        local = self.local
        return len(local.features) + local.n_blocks * local.n_pos + local.n_pos

    def __call__(self, targets: torch.Tensor, last: bool = False) -> torch.Tensor:
        """Rows ``[len(targets), width]`` of ``targets`` (a feature's index below F, else
        F + a logit node's)."""
        local, feats, F = self.local, self.local.features, len(self.local.features)
        B, P, d = len(targets), local.n_pos, local.embeddings.shape[1]
        rows = torch.arange(B)
        inject, final = {}, None
        is_feature = targets < F
        for layer in feats.model_layer[targets[is_feature]].unique().tolist():
            sel = is_feature.clone()
            sel[is_feature] = feats.model_layer[targets[is_feature]] == layer
            g = torch.zeros(self.batch, P, d)
            g[rows[sel], feats.pos[targets[sel]]] = self.enc_w[targets[sel]]
            inject[layer] = g
        if (~is_feature).any():
            final = torch.zeros(self.batch, d)
            final[rows[~is_feature]] = self.logit_dirs[targets[~is_feature] - F]
        with torch.enable_grad():
            grads = self.forward.of(inject, final, last)
        grads = [g[:B] for g in grads]
        out = torch.empty(B, self.width)
        values = out[:, :F]
        values.zero_()
        for s, (pad, slot_pos) in self.slots.items():
            got = torch.zeros(len(pad), B, pad.shape[1])
            latents = feats.latent[pad.clamp_min(0)]
            for block, rows_ in self.writes[s]:
                if rows_.ndim == 2:  # not kept: gathered now
                    rows_ = rows_[latents].transpose(1, 2)
                at = grads[block].transpose(0, 1)[slot_pos]  # [slots, B, d]
                got.baddbmm_(at, rows_)  # [slots, B, m]
            keep = pad >= 0
            values[:, pad[keep]] = got.permute(1, 0, 2)[:, keep]
        values *= feats.value
        err = out[:, F : F + local.n_blocks * P].view(B, local.n_blocks, P)
        for i in range(local.n_blocks):
            err[:, i] = (grads[i] * local.errors[i]).sum(-1)
        out[:, F + local.n_blocks * P :] = (grads[-1] * local.embeddings).sum(-1)
        return out


def constant_terms(local: LocalReplacement, logit_dirs, selected: torch.Tensor) -> torch.Tensor:
    """Every target (the ``selected`` features, then the logit nodes) with every source at
    zero ``[len(selected) + K]``."""
    none = Features(*(torch.zeros(0, dtype=t.dtype) for t in (
        local.features.layer, local.features.model_layer, local.features.pos,
        local.features.latent, local.features.value)))  # fmt: skip
    values, err, emb = (torch.zeros(1, 0), torch.zeros(1, local.n_blocks, local.n_pos),
                        torch.zeros(1, local.n_pos))  # fmt: skip
    with torch.no_grad():
        xs, final = local.run(values, err, emb, none)
        pre = local.pre_activations(xs, local.features.subset(selected))[0]
        return torch.cat([pre, final[0] @ logit_dirs.T])


def influences(rows: torch.Tensor, row_nodes: torch.Tensor, logit_probabilities: torch.Tensor,
               n_nodes: int) -> torch.Tensor:  # fmt: skip
    """Each node's influence on the logit nodes (the last ``K`` of ``n_nodes``) through the
    attributed ``rows`` (``[R, width]``, row i the node ``row_nodes[i]``): ``w (Â + Â² +
    ...)`` over the rows known so far, as circuit-tracer ranks features for partial
    attribution (float32, its normalisation)."""
    norm = rows.abs()
    norm /= norm.sum(1, keepdim=True).clamp(min=1e-8)
    prod = torch.zeros(n_nodes)
    prod[-len(logit_probabilities) :] = logit_probabilities
    total = torch.zeros(n_nodes)
    for _ in range(n_nodes + 1):
        prod = torch.nn.functional.pad(prod[row_nodes] @ norm, (0, n_nodes - norm.shape[1]))
        if not prod.any():
            return total
        total += prod
    raise AttributionError("the influence does not converge: the graph has a cycle")


def attribute_local(local: LocalReplacement, config: AttributionConfig = AttributionConfig(),
                    prompt: str = "", progress: bool = False) -> AttributionGraph:  # fmt: skip
    """The graph of a captured prompt: every active feature's row, or (``config.
    max_feature_nodes``) the logits' rows first and then the features' in order of their
    influence on the logits, re-ranked every ``update_interval`` batches, until the limit
    (circuit-tracer's partial attribution). The graph holds the attributed features, every
    error, embedding and logit node; its adjacency is over those nodes only."""
    F = len(local.features)
    ids, probs = salient_logits(local.logits[-1], config.max_logits, config.logit_probability)
    dirs = logit_directions(local, ids)
    K = len(ids)
    limit = min(config.max_feature_nodes or F, F)
    attributed = _Rows(local, min(config.batch_size, max(limit, K)), dirs)
    n_src = attributed.width
    # row i of ``rows`` is node ``row_nodes[i]``: the logits first, then features in the
    # order attributed (memory: (limit + K) rows of every source)
    rows = torch.zeros(limit + K, n_src)
    row_nodes = torch.zeros(limit + K, dtype=torch.long)
    for lo in range(0, K, config.batch_size):
        hi = min(lo + config.batch_size, K)
        rows[lo:hi] = attributed(torch.arange(lo, hi) + F, last=limit == 0 and hi == K)
        row_nodes[lo:hi] = torch.arange(lo, hi) + n_src
    filled, visited = K, torch.zeros(F, dtype=torch.bool)
    bar = tqdm(total=limit, desc="attribution", unit="feature", disable=not progress)
    while filled < limit + K:
        if limit == F:
            pending = torch.arange(F)
        else:
            inf = influences(rows[:filled], row_nodes[:filled], probs, n_src + K)
            rank = torch.argsort(inf[:F], descending=True)
            queue = min(config.update_interval * config.batch_size, limit + K - filled)
            pending = rank[~visited[rank]][:queue]
        for chunk in pending.split(config.batch_size):
            hi = filled + len(chunk)
            rows[filled:hi] = attributed(chunk, last=hi == limit + K)
            row_nodes[filled:hi] = chunk
            visited[chunk] = True
            filled = hi
            bar.update(len(chunk))
    bar.close()
    selected = visited.nonzero()[:, 0]
    # the graph's nodes: the attributed features (in feature order), then the rest
    columns = torch.cat([selected, torch.arange(F, n_src)])
    order = torch.argsort(row_nodes[K:])  # feature rows in feature order
    n = len(columns) + K
    adjacency = torch.zeros(n, n)
    adjacency[: len(selected), : n - K] = rows[K:][order][:, columns]
    adjacency[n - K :, : n - K] = rows[:K][:, columns]
    del rows
    feats = local.features.subset(selected)
    const = constant_terms(local, dirs, selected)
    bias, values = torch.zeros(n), torch.zeros(n)
    bias[: len(selected)], bias[n - K :] = const[: len(selected)], const[len(selected) :]
    with torch.no_grad():
        x = torch.stack([local.mlp_in[int(b)][int(p)]
                         for b, p in zip(feats.model_layer, feats.pos, strict=True)]) \
            if len(feats) else torch.zeros(0, local.embeddings.shape[1])  # fmt: skip
        w, b = local.encoder_rows(feats)
        values[: len(selected)] = (x * w).sum(-1) + b
        logits = local.logits[-1]
        values[n - K :] = logits[ids] - logits.mean()
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
        n_active=F,
    )


def attribute(replacement_model, tokens, config: AttributionConfig = AttributionConfig(),
              prompt: str = "", progress: bool = False) -> AttributionGraph:  # fmt: skip
    """The unpruned attribution graph of ``tokens`` (``[P]`` ids, BOS included if the
    model wants one) through ``replacement_model`` (``circuits.ReplacementModel``)."""
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    if tokens.ndim != 1 or len(tokens) == 0:
        raise AttributionError("a prompt must be a non-empty 1-D sequence of token ids")
    context = getattr(replacement_model.model.config, "max_position_embeddings", None)
    if context and len(tokens) > context:
        raise AttributionError(f"a prompt of {len(tokens)} tokens exceeds the model's {context}")
    local = replacement_model.capture(tokens, config.first_position)
    return attribute_local(local, config, prompt, progress)
