"""Interventions: set features of a prompt's replacement model to new values (0 to
ablate) and see what the logits do.

``mode="direct"``: the frozen local replacement model (``local.py``) with every other
node held at its clean value: a logit node moves by exactly the sum of the changed
features' edges to it scaled by their relative change (``A[j, f] (new - a_f) / a_f``),
the claim an attribution graph makes. ``mode="full"``: the model itself with each MLP
block replaced by the transcoders' output plus the prompt's error (constant), attention
and normalisation live, every feature recomputed downstream of the change; with no
change it is the model exactly.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .local import AttributionError, Features, LocalReplacement, _parts

Key = tuple[int, int, int]
"""A feature: (model block, position, latent)."""


@dataclass(frozen=True)
class InterventionResult:
    """The last position's logits before and after (``[V]``) and their difference."""

    clean: torch.Tensor
    changed: torch.Tensor

    @property
    def delta(self) -> torch.Tensor:
        return self.changed - self.clean

    def demeaned_delta(self) -> torch.Tensor:
        """The change of each logit minus the mean logit (a graph's logit node)."""
        return self.delta - self.delta.mean()


def _with_changes(local: LocalReplacement, changes: Mapping[Key, float]):
    """The prompt's features plus any newly set ones, and their values ``[1, F']``."""
    f = local.features
    keys = {(int(a), int(b), int(c)): i for i, (a, b, c) in
            enumerate(zip(f.model_layer, f.pos, f.latent, strict=True))}  # fmt: skip
    layer, model_layer, pos, latent = (
        list(t.tolist()) for t in (f.layer, f.model_layer, f.pos, f.latent)
    )
    values = f.value.tolist()
    blocks = local.block_of_layer
    for (block, p, lat), v in changes.items():
        if block not in blocks or not 0 <= p < local.n_pos:
            raise AttributionError(f"no feature ({block}, {p}, {lat}) in this prompt's model")
        if (block, p, lat) in keys:
            values[keys[(block, p, lat)]] = float(v)
        else:
            layer.append(blocks.index(block)), model_layer.append(block)
            pos.append(p), latent.append(lat), values.append(float(v))
    t = [torch.tensor(x, dtype=torch.long) for x in (layer, model_layer, pos, latent)]
    return Features(*t, torch.tensor(values)), torch.tensor(values)[None]


@torch.no_grad()
def intervene(local: LocalReplacement, changes: Mapping[Key, float], *, mode: str = "direct"):
    """The logits with the features in ``changes`` set to their values (module docstring)."""
    if mode == "direct":
        feats, values = _with_changes(local, changes)
        _, err, emb = local.clean_sources()
        head = _parts(local.model).head
        clean = head(local.run(*local.clean_sources())[1])[0]
        return InterventionResult(clean, head(local.run(values, err, emb, feats)[1])[0])
    if mode == "full":
        return InterventionResult(_replaced_logits(local, {}), _replaced_logits(local, changes))
    raise AttributionError(f"mode must be 'direct' or 'full', got {mode!r}")


def _replaced_logits(local: LocalReplacement, changes: Mapping[Key, float]) -> torch.Tensor:
    """The model's last logits with each covered MLP replaced (``mode="full"``)."""
    tc, clt = local.transcoders, local.transcoders.clt
    blocks = local.block_of_layer
    parts = _parts(local.model)
    codes: dict[int, torch.Tensor] = {}
    hooks = []

    def replace(i):
        def hook(module, args, output):
            if i not in blocks:
                return local.errors[i][None]  # no transcoder: the block's clean output
            t = blocks.index(i)
            code = tc.encode(t, args[0][0])
            for (block, p, lat), v in changes.items():
                if block == i:
                    code[p, lat] = v
            codes[t] = code
            out = sum(codes[s] @ clt.decoder(s, t) for s in tc.sources(t)) + clt.decoder_bias[t]
            return (out + local.errors[i])[None]

        return hook

    for i, block in enumerate(parts.layers):
        hooks.append(block.mlp.register_forward_hook(replace(i)))
    try:
        return local.model(input_ids=local.tokens[None]).logits[0, -1]
    finally:
        for h in hooks:
            h.remove()
