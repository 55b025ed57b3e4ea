"""How good a replacement model is, on held-out text. Against the clean model:

- ``ce``: next-token cross-entropy with every MLP replaced at once (``ReplacementModel``);
- ``ce_loss_recovered`` = (CE_zero - CE) / (CE_zero - CE_clean), with every MLP output
  zero-ablated at once as the baseline (``ce_loss_recovered_mean``: every MLP output
  replaced by its mean over the held-out tokens);
- ``kl``: KL(clean || replaced) of the next-token distributions, nats per token;
- ``top1``: the fraction of tokens whose most likely next token is the clean model's;
- per block, the FVU of the MLP output: in the replaced run (``fvu_replaced``: y_hat
  against the block's own output on the inputs the replaced model gives it, the error
  node's size) and in the clean run (``fvu_clean``: y_hat from the clean inputs against
  the clean outputs).

Splices and ablations act on real tokens only, and leave a BOS the tokenizer adds clean
unless ``splice_bos`` (the dictionaries are trained without it, the extraction's
default); the loss counts every real next token."""

from __future__ import annotations

import os
from collections.abc import Mapping
from contextlib import ExitStack

import torch

from ..lut.evaluate import Splice, _device_batches, _positions, _recovered, next_token_stats
from .replacement import Replacement, ReplacementError, ReplacementModel


class _Sums:
    """Running sums of one variant: CE, KL, top-1 agreements, and per block the FVU's
    squared error, output sums and squared norms."""

    def __init__(self):
        self.ce = self.kl = 0.0
        self.agree = 0
        self.fvu: dict[str, list] = {}

    def add_fvu(self, trace, where: torch.Tensor) -> None:
        for block, y in trace.outputs.items():
            y = y[where].double()
            err = (y - trace.replaced[block][where].double()).pow(2).sum()
            s = self.fvu.setdefault(block, [0.0, 0.0, 0.0, 0])
            s[0] += float(err)
            s[1] = s[1] + y.sum(0)
            s[2] += float(y.pow(2).sum())
            s[3] += len(y)

    def fvus(self) -> dict[str, float]:
        out = {}
        for block, (err, total, squares, n) in self.fvu.items():
            var = squares - float(total.pow(2).sum()) / max(n, 1)
            out[block] = err / var if var > 0 else float("nan")
        return out


def _stats(logits, batch, clean_logp, clean_top, sums: _Sums) -> None:
    ce, kl, _, logp = next_token_stats(logits, batch, clean_logp)
    sums.ce += ce
    sums.kl += kl
    sums.agree += int((logp.argmax(-1) == clean_top).sum())


def _mean_outputs(rm: ReplacementModel, batches, positions) -> dict[str, torch.Tensor]:
    """Each block's mean output over the clean run's spliced positions."""
    total: dict[str, torch.Tensor] = {}
    count = 0
    for batch in batches:
        where = positions(batch)
        trace = rm.forward(batch, replace=False, record=True).trace
        for block, y in trace.outputs.items():
            total[block] = total.get(block, 0) + y[where].double().sum(0)
        count += int(where.sum())
    return {b: (t / max(count, 1)).float() for b, t in total.items()}


def _ablated(model, blocks, means, kind: str, where, stack: ExitStack) -> None:
    for block in blocks:
        replace = torch.zeros_like if kind == "zero" else (lambda y, m=means[block]: m.expand_as(y))
        splice = stack.enter_context(Splice(model, f"{block}:output", replace))
        splice.where = where


@torch.no_grad()
def replacement_evaluation(
    model,
    tokenizer,
    texts: list[str],
    replacements: Mapping[str, Replacement],
    *,
    max_length: int = 128,
    batch_size: int = 16,
    splice_bos: bool = False,
) -> dict:
    """Every replacement of ``replacements`` (``{name: Replacement}``, e.g. "clt",
    "per_layer", "lut") on ``texts`` (module docstring). The ablation baselines ablate the
    blocks of the first replacement. Returns ``{"tokens", "ce_clean", "ce_zero_ablated",
    "ce_mean_ablated", "blocks", "models": {name: {"ce", "kl", "top1",
    "ce_loss_recovered", "ce_loss_recovered_mean", "fvu_replaced": {block: fvu},
    "fvu_clean": {block: fvu}}}}``. The model is left as it was."""
    batches = _device_batches(model, tokenizer, texts, max_length, batch_size)
    positions = _positions(tokenizer, splice_bos)
    rms = {name: ReplacementModel(model, r) for name, r in replacements.items()}
    blocks = next(iter(rms.values())).blocks
    means = _mean_outputs(next(iter(rms.values())), batches, positions)
    sums = {key: _Sums() for key in [*rms, *(f"{n}:clean" for n in rms), "zero", "mean"]}
    tokens, ce_clean = 0, 0.0
    for batch in batches:
        where = positions(batch)
        ce, _, n, clean_logp = next_token_stats(model(**batch).logits, batch)
        tokens, ce_clean, clean_top = tokens + n, ce_clean + ce, clean_logp.argmax(-1)
        for name, rm in rms.items():
            run = rm.forward(batch, where=where, record=True)
            _stats(run.logits, batch, clean_logp, clean_top, sums[name])
            sums[name].add_fvu(run.trace, where)
            sums[f"{name}:clean"].add_fvu(
                rm.forward(batch, replace=False, record=True).trace, where
            )
        for kind in ("zero", "mean"):
            with ExitStack() as stack:
                _ablated(model, blocks, means, kind, where, stack)
                _stats(model(**batch).logits, batch, clean_logp, clean_top, sums[kind])
    return _report(sums, list(rms), blocks, tokens, ce_clean)


def _report(sums: dict, names: list[str], blocks, tokens: int, ce_clean: float) -> dict:
    ce_clean /= tokens
    ce_zero, ce_mean = sums["zero"].ce / tokens, sums["mean"].ce / tokens
    models = {}
    for name in names:
        s = sums[name]
        ce = s.ce / tokens
        models[name] = {
            "ce": ce,
            "kl": s.kl / tokens,
            "top1": s.agree / tokens,
            "ce_loss_recovered": _recovered(ce_zero, ce, ce_clean),
            "ce_loss_recovered_mean": _recovered(ce_mean, ce, ce_clean),
            "fvu_replaced": s.fvus(),
            "fvu_clean": sums[f"{name}:clean"].fvus(),
        }
    return {
        "tokens": tokens,
        "ce_clean": ce_clean,
        "ce_zero_ablated": ce_zero,
        "ce_mean_ablated": ce_mean,
        "kl_zero_ablated": sums["zero"].kl / tokens,
        "kl_mean_ablated": sums["mean"].kl / tokens,
        "top1_zero_ablated": sums["zero"].agree / tokens,
        "top1_mean_ablated": sums["mean"].agree / tokens,
        "blocks": list(blocks),
        "models": models,
    }


def evaluate_replacements(
    model_dir: str | os.PathLike,
    texts: list[str],
    *,
    clt: str | os.PathLike | None = None,
    transcoders: Mapping[str, str | os.PathLike] | None = None,
    lut_dir: str | os.PathLike | None = None,
    **kwargs,
) -> dict:
    """``replacement_evaluation`` of the causal LM in ``model_dir`` (loaded offline as the
    extraction loads it) with a CLT (``"clt"``), per-layer transcoders (``"per_layer"``,
    ``{block: checkpoint}``) and a LUT directory's MLP blocks (``"lut"``), those given."""
    from ..extract.model import load_model
    from .replacement import clt_replacement, lut_replacement, transcoder_replacement

    tokenizer, model = load_model(model_dir)
    replacements = {}
    if clt is not None:
        replacements["clt"] = clt_replacement(model, clt)
    if transcoders:
        replacements["per_layer"] = transcoder_replacement(model, transcoders)
    if lut_dir is not None:
        replacements["lut"] = lut_replacement(model, lut_dir)
    if not replacements:
        raise ReplacementError("nothing to evaluate: give clt, transcoders or lut_dir")
    return replacement_evaluation(model, tokenizer, texts, replacements, **kwargs)
