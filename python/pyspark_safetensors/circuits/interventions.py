"""Interventions: set features of a prompt to new values (0 to ablate) and see what the
logits do. A feature is ``(model block, position, latent)``; ``local`` is the prompt's
``LocalReplacement`` (``ReplacementModel.capture``).

- ``mode="full"`` (circuit-tracer's ``feature_intervention``): the model itself, its MLPs
  real; at each changed feature's layer the feature's activation in this run is set to
  the new value, and the change of what it decodes (``(new - now) W_dec^{s->t}``, into
  every block ``t`` it writes: a CLT's feature writes every later block) is added to the
  real MLP outputs. Every downstream layer responds through the real network. Attention
  patterns are frozen at the prompt's clean values (``freeze_attention``, the default,
  as circuit-tracer's), the normalisations live. With no change it is the model.
- ``mode="replaced"``: the model with every replaced MLP block swapped for the
  replacement's output plus the prompt's error (a constant), attention and
  normalisations live, every feature recomputed downstream of the change from the
  replaced inputs. It differs from "full" where the dictionary misses the MLP's
  response to the change: "full" keeps the real MLPs' response, this one the
  dictionary's (the replacement model's own claim). With no change it is the model.
- ``mode="direct"``: the frozen local replacement model with every other node held at
  its clean value: a logit node moves by exactly the sum of the changed features' edges
  to it scaled by their relative change (``A[j, f] (new - a_f) / a_f``), the claim an
  attribution graph makes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass

import torch

from .errors import ReplacementError
from .local import Features, LocalReplacement, _frozen_attention, _parts

Key = tuple[int, int, int]
"""A feature: (model block, position, latent)."""

MODES = ("full", "replaced", "direct")


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


@torch.no_grad()
def intervene(local: LocalReplacement, changes: Mapping[Key, float], *, mode: str = "direct",
              freeze_attention: bool = True) -> InterventionResult:  # fmt: skip
    """The last position's logits with the features in ``changes`` set to their values
    (module docstring); ``freeze_attention`` applies to ``mode="full"``."""
    if mode not in MODES:
        raise ReplacementError(f"mode must be one of {MODES}, got {mode!r}")
    by_layer = _changes_by_layer(local, changes)
    if mode == "direct":
        feats, values = _with_changes(local, changes)
        _, err, emb = local.clean_sources()
        head = _parts(local.model).head
        clean = head(local.run(*local.clean_sources())[1])[0]
        return InterventionResult(clean, head(local.run(values, err, emb, feats)[1])[0])
    run = _steered_logits if mode == "full" else _replaced_logits
    options = {"freeze_attention": freeze_attention} if mode == "full" else {}
    return InterventionResult(run(local, {}, **options), run(local, by_layer, **options))


def _changes_by_layer(local: LocalReplacement, changes: Mapping[Key, float]):
    """``{replacement layer: [(position, latent, value)]}``, each checked."""
    rep = local.replacement
    out = defaultdict(list)
    for (block, p, latent), value in changes.items():
        if block not in local.block_of_layer or not 0 <= p < local.n_pos:
            raise ReplacementError(f"no feature ({block}, {p}, {latent}) in this prompt's model")
        layer = local.block_of_layer.index(block)
        if not 0 <= latent < rep.encoder_weight[layer].shape[0]:
            raise ReplacementError(f"block {block} has no latent {latent}")
        out[layer].append((p, latent, float(value)))
    return dict(out)


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
        if (block, p, lat) in keys:
            values[keys[(block, p, lat)]] = float(v)
        else:
            layer.append(blocks.index(block)), model_layer.append(block)
            pos.append(p), latent.append(lat), values.append(float(v))
    t = [torch.tensor(x, dtype=torch.long) for x in (layer, model_layer, pos, latent)]
    return Features(*t, torch.tensor(values)), torch.tensor(values)[None]


def _steered_logits(local: LocalReplacement, by_layer, *, freeze_attention: bool) -> torch.Tensor:
    """The model's last logits, real MLPs plus the changed features' decoder deltas
    (``mode="full"``)."""
    rm, rep = local.replacement_model, local.replacement
    steering: dict[int, torch.Tensor] = {}  # target layer -> what to add to its output [P, d]

    def steer(layer: int):
        def hook(module, args, output):
            if layer in by_layer:
                code = rep.encode(layer, args[0][0])  # this run's activations
                for target in range(layer, rep.n_layers):
                    if layer not in rep.decoders[target]:
                        continue
                    add = steering.setdefault(target, torch.zeros_like(output[0]))
                    w = rep.decoder(layer, target)
                    for p, latent, value in by_layer[layer]:
                        add[p] += (value - code[p, latent]) * w[latent]
            if layer not in steering:
                return None
            return output + steering[layer].to(output.dtype)

        return hook

    with ExitStack() as stack:
        for layer, module in enumerate(rm._modules):
            stack.callback(module.register_forward_hook(steer(layer)).remove)
        if freeze_attention:
            for i, block in enumerate(_parts(local.model).layers):
                hook = _frozen_pattern(local.patterns[i])
                stack.callback(block.self_attn.register_forward_hook(hook, with_kwargs=True).remove)
        return local.model(input_ids=local.tokens[None]).logits[0, -1]


def _frozen_pattern(pattern: torch.Tensor):
    """A hook making an attention module's output that of its clean ``pattern``."""

    def hook(module, args, kwargs, output):
        normed = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        return (_frozen_attention(module, normed, pattern), *output[1:])

    return hook


def _replaced_logits(local: LocalReplacement, by_layer) -> torch.Tensor:
    """The model's last logits with each replaced MLP the replacement's output plus the
    prompt's error, the changed features set in their layer's code (``mode="replaced"``)."""

    def edit(layer: int, code: torch.Tensor) -> torch.Tensor:
        for p, latent, value in by_layer.get(layer, ()):
            code[p, latent] = value
        return code

    errors = [local.errors[b][None].clone() for b in local.block_of_layer]
    if local.first_errors is not None:  # position 0's errors, no nodes in ``local``
        for e, b in zip(errors, local.block_of_layer, strict=True):
            e[0, 0] = local.first_errors[b]
    with local.replacement_model.hooked(edit=edit, add=errors):
        return local.model(input_ids=local.tokens[None]).logits[0, -1]
