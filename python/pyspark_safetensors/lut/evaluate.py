"""How good a LUT is: per layer, on held-out activations, the relative L2 error and the
cosine similarity of the LUT output against the exact ``x @ W_target``, for several k and
compensation sizes m; and end to end, how close a patched model's embeddings stay."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F

from .inference import LUTMLP, LUTLinear, load_layer_file, patch_model
from .precompute import ModelWeights
from .spec import LINEAR, MLP, LUTError, check_blocks, entry_kind, validate_lut


@torch.no_grad()
def evaluate_layer(
    tensors: dict[str, torch.Tensor],
    weight: torch.Tensor,
    x: torch.Tensor,
    *,
    ks: Iterable[int],
    ms: Iterable[int] = (0, 8, 32),
) -> list[dict]:
    """Rows ``{k, m, rel_l2, cosine}`` comparing the LUT (without any layer bias) with
    ``x @ weight.T`` on ``x [N, input_dim]``."""
    x = x.to(torch.float32)
    exact = x @ weight.to(torch.float32).T
    rows = []
    for k in ks:
        for m in ms:
            lut = LUTLinear(tensors, k, weight=weight if m else None, compensate=m)
            out = lut(x)
            rows.append({
                "k": k,
                "m": m,
                "rel_l2": float((out - exact).norm() / exact.norm()),
                "cosine": float(F.cosine_similarity(out, exact, dim=-1).mean()),
            })  # fmt: skip
    return rows


def evaluate(
    lut_dir: str | os.PathLike,
    model_dir: str | os.PathLike,
    activations: Mapping[str, torch.Tensor],
    *,
    ks: Iterable[int] | None = None,
    ms: Iterable[int] = (0, 8, 32),
    out_dir: str | os.PathLike | None = None,
) -> list[dict]:
    """Evaluate every layer of ``activations`` (``{layer: held-out inputs [N, d]}``).
    Writes ``evaluation.md`` (a table) and ``evaluation.png`` (error against k per
    compensation size) into ``out_dir`` when given."""
    meta = validate_lut(lut_dir)
    model = ModelWeights(model_dir)
    k_active = meta["sae_config"]["k_active"]
    ks = sorted(set(ks or (max(1, k_active // 4), max(1, k_active // 2), k_active, 2 * k_active)))
    ks = [k for k in ks if k <= meta["sae_config"]["num_basis"]]
    rows = []
    for layer, x in activations.items():
        entry = meta["layers"][layer]
        if entry_kind(entry) == MLP:
            raise LUTError(
                f"{layer!r} is an MLP block's LUT, whose output is its transcoder's: evaluate "
                "it with lm_loss_evaluation (transcoders=, lut_dir=), not against a linear layer"
            )
        tensors = load_layer_file(Path(lut_dir) / entry["file"])
        for row in evaluate_layer(tensors, model.weight(layer), x, ks=ks, ms=ms):
            rows.append({"layer": layer, **row})
    if out_dir is not None:
        write_report(rows, Path(out_dir), k_active)
    return rows


def write_report(rows: list[dict], out_dir: Path, k_active: int | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    lines = ["| layer | k | m | relative L2 error | cosine |", "|---|---|---|---|---|"]
    lines += [
        f"| {r['layer']} | {r['k']} | {r['m']} | {r['rel_l2']:.4f} | {r['cosine']:.4f} |"
        for r in rows
    ]
    (out_dir / "evaluation.md").write_text("\n".join(lines) + "\n")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in zip(
        axes, ("rel_l2", "cosine"), ("relative L2 error vs exact layer", "cosine vs exact layer"),
        strict=True,
    ):  # fmt: skip
        for layer in dict.fromkeys(r["layer"] for r in rows):
            for m in dict.fromkeys(r["m"] for r in rows):
                sel = [r for r in rows if r["layer"] == layer and r["m"] == m]
                ax.plot([r["k"] for r in sel], [r[key] for r in sel], marker="o", markersize=3,
                        linestyle="-" if m == 0 else "--", label=f"{layer} m={m}")  # fmt: skip
        if k_active is not None:
            ax.axvline(k_active, color="grey", linewidth=0.8, linestyle=":")
        ax.set_xlabel("k (active latents; dotted: the trained k)")
        ax.set_title(label, fontsize=9)
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(
        handles, labels, fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False
    )
    fig.tight_layout()
    fig.savefig(out_dir / "evaluation.png", dpi=110, bbox_inches="tight")
    plt.close(fig)


@torch.no_grad()
def embedding_agreement(
    model_dir: str | os.PathLike,
    lut_dir: str | os.PathLike,
    texts: list[str],
    *,
    compensate: int = 0,
    max_length: int = 128,
) -> float:
    """Mean cosine similarity between the mean-pooled final hidden states of the original
    model and of the model with its LUT layers patched in (a sentence-embedding model's
    own output, e.g. MiniLM)."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    batch = tokenizer(
        texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt"
    )
    mask = batch["attention_mask"].unsqueeze(-1).float()

    def embed(model):
        hidden = model(**batch).last_hidden_state
        return (hidden * mask).sum(1) / mask.sum(1)

    model = AutoModel.from_pretrained(model_dir).eval()
    original = embed(model)
    patch_model(model, lut_dir, compensate=compensate)
    return float(F.cosine_similarity(embed(model), original, dim=-1).mean())


def evaluate_on_passages(
    lut_dir: str | os.PathLike,
    model_dir: str | os.PathLike | None = None,
    *,
    texts: int = 64,
    skip: int = 600,
    max_length: int = 128,
    ks: Iterable[int] | None = None,
    ms: Iterable[int] = (0, 32),
    out_dir: str | os.PathLike | None = None,
) -> dict:
    """The ``evaluate`` stage: ``texts`` corpus passages after the first ``skip`` (those
    the SAEs trained on) are run through the model (``model_dir``, default the packaged
    all-MiniLM-L6-v2) to collect every LUT layer's inputs; returns ``{"layers": rows of
    evaluate(), "embedding_cosine": {m: cosine of the sentence embeddings with every LUT
    layer patched in, compensation m}}``."""
    from ..extract import Extractor, default_model_dir, passages_by_key

    meta = validate_lut(lut_dir)
    model_dir = model_dir or default_model_dir()
    passages = passages_by_key(skip, texts)
    # the linear layers' inputs (an MLP block's LUT is its transcoder: no layer to compare)
    hooks = [f"{name}:input" for name, e in meta["layers"].items() if entry_kind(e) != MLP]
    windows = Extractor(model_dir, hooks, max_length=max_length).run(passages)
    inputs = {
        h.rsplit(":", 1)[0]: torch.cat(
            [torch.from_numpy(w.activations[h].astype("float32")) for w in windows]
        )
        for h in hooks
    }
    ms = list(ms)
    rows = evaluate(lut_dir, model_dir, inputs, ks=ks, ms=ms, out_dir=out_dir)
    cosines = {
        m: embedding_agreement(model_dir, lut_dir, passages, compensate=m, max_length=max_length)
        for m in ms
    }
    return {"layers": rows, "embedding_cosine": cosines}


# ------------------------------------------------------------------ language-model loss
#
# What SAE papers report for a causal language model (SAELens' evals, sparsify): the
# next-token cross-entropy on held-out texts, clean and with the SAE's reconstruction
# spliced in at its hook point; the same with the activation zero- and mean-ablated; the
# fraction of the loss recovered, (CE_zero - CE_spliced) / (CE_zero - CE_clean); and the
# KL divergence of the next-token distributions to the clean ones. The same for the model
# with its LUT layers patched in.


class Splice:
    """A context manager that replaces the activation at a hook point (``module:input`` or
    ``module:output``, the extraction's names) by ``replace(activation)`` during forward
    passes, at the positions ``where`` (``[batch, seq]`` bool, set before each forward;
    None = everywhere). The hooks are removed on exit, leaving the model as it was.

    ``module:input`` replaces the input of every module in ``shared`` too: the layers that
    read the very same tensor (a Llama block's q, k and v projections, or gate and up),
    which an SAE on that input replaces together, as their LUT layers do; the activation is
    replaced once, whichever of them runs first (``shared_input_modules`` finds them).

    ``from_input`` (``module:output`` only): the output is replaced by ``replace(the
    module's input)``, as a transcoder replaces an MLP block's output."""

    def __init__(
        self, model, hook: str, replace, shared: Iterable[str] = (), *, from_input: bool = False
    ):
        self.model, self.replace, self.where = model, replace, None
        self.module, _, self.kind = hook.rpartition(":")
        if self.kind not in ("input", "output"):
            raise LUTError(f"hook {hook!r} must end with ':input' or ':output'")
        if from_input and self.kind != "output":
            raise LUTError(f"hook {hook!r}: from_input replaces a module's output")
        self.from_input = from_input
        self.modules = (
            list(dict.fromkeys([self.module, *shared])) if self.kind == "input" else [self.module]
        )
        self._handles: list = []
        self._last: tuple | None = None  # (input, its replacement) of the current forward

    def _swap(self, x: torch.Tensor, source: torch.Tensor | None = None) -> torch.Tensor:
        new = self.replace(x if source is None else source).to(x.dtype)
        if self.where is not None:
            new = torch.where(self.where.to(x.device)[..., None], new, x)
        return new

    def _pre(self, module, args):
        x = args[0]
        if self._last is None or self._last[0] is not x:
            self._last = (x, self._swap(x))
        return (self._last[1], *args[1:])

    def _post(self, module, args, output):
        source = args[0] if self.from_input else None
        if isinstance(output, tuple):
            return (self._swap(output[0], source), *output[1:])
        return self._swap(output, source)

    def __enter__(self) -> Splice:
        modules = dict(self.model.named_modules())
        for name in self.modules:
            if self.kind == "input":
                self._handles.append(modules[name].register_forward_pre_hook(self._pre))
            else:
                self._handles.append(modules[name].register_forward_hook(self._post))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._last = None


@torch.no_grad()
def shared_input_modules(model, module: str, batch: dict) -> list[str]:
    """The leaf modules that receive, in one forward pass of ``batch``, the very tensor
    ``module`` receives as its input (``module`` included, in call order)."""
    seen: list[tuple[str, torch.Tensor]] = []
    handles = []
    for name, m in model.named_modules():
        if name and not any(True for _ in m.children()):

            def hook(mod, args, name=name):
                if args and isinstance(args[0], torch.Tensor):
                    seen.append((name, args[0]))

            handles.append(m.register_forward_pre_hook(hook))
    try:
        model(**batch)
    finally:
        for handle in handles:
            handle.remove()
    target = next((t for name, t in seen if name == module), None)
    if target is None:
        raise LUTError(f"module {module!r} is not a leaf module called by the model")
    return [name for name, t in seen if t is target]


def lm_batches(tokenizer, texts: list[str], *, max_length: int, batch_size: int) -> list[dict]:
    """``texts`` (each cut to ``max_length`` tokens) as right-padded model inputs:
    ``input_ids`` and ``attention_mask`` (a tokenizer without a pad token pads with any
    id: the mask hides it, and causal attention never looks right)."""
    ids = tokenizer(texts, truncation=True, max_length=max_length)["input_ids"]
    ids = [row for row in ids if len(row) > 1]  # one token predicts nothing
    if not ids:
        raise LUTError("no text of at least two tokens to evaluate the loss on")
    pad = next((i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id) if i is not None), 0)
    batches = []
    for start in range(0, len(ids), batch_size):
        rows = ids[start : start + batch_size]
        width = max(map(len, rows))
        input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            input_ids[i, : len(row)] = torch.tensor(row)
            mask[i, : len(row)] = 1
        batches.append({"input_ids": input_ids, "attention_mask": mask})
    return batches


def next_token_stats(logits: torch.Tensor, batch: dict, clean_logp: torch.Tensor | None = None):
    """``(summed cross-entropy, summed KL(clean || this), predicted tokens)`` over the
    real next tokens of ``batch``; the KL is 0 when ``clean_logp`` is None."""
    mask = batch["attention_mask"][:, 1:].bool()
    logp = F.log_softmax(logits[:, :-1].float(), dim=-1)[mask]  # [tokens, vocab]
    targets = batch["input_ids"][:, 1:][mask]
    ce = -logp.gather(1, targets[:, None]).sum()
    kl = torch.zeros(())
    if clean_logp is not None:
        kl = (clean_logp.exp() * (clean_logp - logp)).sum()
    return float(ce), float(kl), int(mask.sum()), logp


@torch.no_grad()
def lm_loss_evaluation(
    model,
    tokenizer,
    texts: list[str],
    *,
    saes: Mapping[str, object] | None = None,
    transcoders: Mapping[str, object] | None = None,
    lut_dir: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
    compensate: Iterable[int] = (0,),
    max_length: int = 128,
    batch_size: int = 16,
    splice_bos: bool = False,
) -> dict:
    """The language-model loss of a causal LM (``model``, ``tokenizer``: loaded, e.g. by
    ``extract.model.load_model``) on ``texts``, clean and intervened on:

    - per hook point of ``saes`` (``{hook: SAE}``, an SAE file or directory that
      ``sae.load_sae_model`` reads, or a loaded SAE module): CE with the SAE's
      reconstruction spliced in, CE with the activation zero-ablated and mean-ablated (the
      mean over the same texts), ``ce_loss_recovered`` = (CE_zero - CE_spliced) /
      (CE_zero - CE_clean) (``ce_loss_recovered_mean`` against mean ablation), and the KL
      divergence of each next-token distribution to the clean one (nats per token);
    - per MLP block replaced whole, that is each block of ``transcoders`` (``{block module,
      e.g. "model.layers.0.mlp": transcoder}``, a checkpoint or a loaded module whose
      ``x_hat`` is the block's output) and each MLP block of the LUT: the same figures with
      the block's output replaced by the transcoder's output from the block's input
      (``spliced``) and by its MLP LUT (``lut``, at every position, as in use), against the
      block's output zero- and mean-ablated;
    - per compensation size ``m`` in ``compensate``, with every LUT layer and block of
      ``lut_dir`` (one directory or several, patched in together) patched in: CE and KL.

    Every splice and ablation touches only real tokens; a BOS token the tokenizer adds
    keeps its clean activations unless ``splice_bos`` (the SAEs are trained without it, the
    extraction's default). LUT layers replace whole modules, so they run at every position,
    as in use. The model is left exactly as it was: hooks removed, patched layers put back.

    Returns ``{"tokens", "ce_clean", "hooks": {hook: {...}}, "mlp": {block: {...}}, "lut":
    {m: {"ce", "kl", "ce_increase"}}}``."""
    batches = _device_batches(model, tokenizer, texts, max_length, batch_size)
    positions = _positions(tokenizer, splice_bos)
    lut_dirs = _lut_dirs(lut_dir)
    hooks = _loaded_saes(model, saes or {}, batches[0])
    luts = {m: _lut_modules(model, lut_dirs, m) for m in compensate} if lut_dirs else {}
    # each MLP block of the LUT alone (compensation does not apply to a block)
    patched = next(iter(luts.values()), None) or _lut_modules(model, lut_dirs, 0)
    mlp_luts = {name: layer for name, layer in patched.items() if isinstance(layer, LUTMLP)}
    blocks = _loaded_transcoders(model, transcoders or {})
    block_names = list(dict.fromkeys([*blocks, *mlp_luts]))
    means = _hook_means(
        model, batches,
        {**{h: shared for h, (_, shared) in hooks.items()},
         **{f"{b}:output": [] for b in block_names}},
        positions,
    )  # fmt: skip
    variants = {
        **_sae_variants(model, hooks, means),
        **_mlp_variants(model, block_names, blocks, mlp_luts, means),
        **{("lut", m): _swap_variant(model, layers) for m, layers in luts.items()},
    }
    sums, tokens, ce_clean = _run_variants(model, batches, positions, variants)
    return _lm_report(sums, tokens, ce_clean, list(hooks), block_names, list(luts))


def _device_batches(model, tokenizer, texts, max_length: int, batch_size: int) -> list[dict]:
    """``lm_batches`` on the model's device (inputs, SAEs and transcoders go there)."""
    device = next(model.parameters()).device
    return [
        {k: v.to(device) for k, v in b.items()}
        for b in lm_batches(tokenizer, texts, max_length=max_length, batch_size=batch_size)
    ]


def _positions(tokenizer, splice_bos: bool):
    """``positions(batch) -> [batch, seq] bool``: where splices and ablations act, every
    real token but a BOS the tokenizer adds (unless ``splice_bos``)."""
    from ..extract.model import bos_added

    skip_first = not splice_bos and bos_added(tokenizer)

    def positions(batch: dict) -> torch.Tensor:
        where = batch["attention_mask"].bool().clone()
        if skip_first:
            where[:, 0] = False
        return where

    return positions


def _lut_dirs(lut_dir) -> list[str | os.PathLike]:
    if lut_dir is None:
        return []
    return [lut_dir] if isinstance(lut_dir, str | os.PathLike) else list(lut_dir)


def _module_on(module, model):
    """A loaded (or a path to a) SAE or transcoder, on the model's device, in eval mode."""
    from ..sae.ecosystem import load_sae_model

    module = load_sae_model(module) if isinstance(module, str | os.PathLike) else module
    return module.to(next(model.parameters()).device).eval()


def _loaded_saes(model, saes: Mapping[str, object], batch: dict) -> dict[str, tuple]:
    """``{hook: (SAE module, the modules sharing its input)}``."""
    out = {}
    for hook, sae in saes.items():
        module = hook.rpartition(":")[0]
        shared = shared_input_modules(model, module, batch) if hook.endswith(":input") else []
        out[hook] = (_module_on(sae, model), shared)
    return out


def _loaded_transcoders(model, transcoders: Mapping[str, object]) -> dict[str, object]:
    """``{block's name in the model: transcoder module}``."""
    from .inference import _find_module

    return {
        _find_module(model, block)[0]: _module_on(tc, model) for block, tc in transcoders.items()
    }


def _lut_modules(model, lut_dirs: list, compensate: int) -> dict[str, torch.nn.Module]:
    """``{module name: LUT layer or block}`` of every directory, built once, the model left
    as it was (they are swapped in per batch)."""
    out = {}
    for lut_dir in lut_dirs:
        with lut_patched(model, lut_dir, compensate=compensate) as patched:
            twice = sorted(set(out) & set(patched))
            if twice:
                raise LUTError(f"{lut_dir}: {twice} already patched in by another LUT directory")
            out.update(patched)
    try:  # patched in together, a block would leave another directory's layers unused
        check_blocks({n: MLP if isinstance(m, LUTMLP) else LINEAR for n, m in out.items()})
    except LUTError as e:
        raise LUTError(f"the LUT directories {[str(d) for d in lut_dirs]} overlap: {e}") from None
    return out


def _reconstruct(sae):
    """``x -> sae(x).x_hat`` on any leading shape (an SAE's reconstruction, a transcoder's
    output)."""

    def replace(x):
        flat = x.reshape(-1, x.shape[-1]).float()
        out = sae(flat).x_hat
        return out.reshape(*x.shape[:-1], out.shape[-1])

    return replace


def _splice_variant(splice: Splice):
    """A variant (``where -> context manager``) that splices at ``where``."""

    def enter(where):
        splice.where = where
        return splice

    return enter


def _swap_variant(model, modules: Mapping[str, torch.nn.Module]):
    """A variant that swaps ``modules`` in (everywhere: ``where`` does not apply)."""
    return lambda where: swapped_modules(model, modules)


def _ablations(model, hook: str, mean: torch.Tensor, shared=()) -> dict[str, object]:
    return {
        "zero": _splice_variant(Splice(model, hook, torch.zeros_like, shared)),
        "mean": _splice_variant(Splice(model, hook, lambda x: mean.expand_as(x), shared)),
    }


def _sae_variants(model, hooks: dict, means: dict) -> dict:
    """Per SAE hook point: its reconstruction spliced in, zero and mean ablation."""
    out = {}
    for hook, (sae, shared) in hooks.items():
        out[(hook, "spliced")] = _splice_variant(Splice(model, hook, _reconstruct(sae), shared))
        for kind, variant in _ablations(model, hook, means[hook], shared).items():
            out[(hook, kind)] = variant
    return out


def _mlp_variants(model, names: list[str], transcoders: dict, mlp_luts: dict, means) -> dict:
    """Per MLP block replaced whole: its output from the transcoder (``spliced``) or from
    its MLP LUT (``lut``), zero and mean ablation of its output."""
    out = {}
    for block in names:
        hook = f"{block}:output"
        if block in transcoders:
            splice = Splice(model, hook, _reconstruct(transcoders[block]), from_input=True)
            out[(block, "spliced")] = _splice_variant(splice)
        if block in mlp_luts:
            out[(block, "lut")] = _swap_variant(model, {block: mlp_luts[block]})
        for kind, variant in _ablations(model, hook, means[hook]).items():
            out[(block, kind)] = variant
    return out


def _run_variants(model, batches: list[dict], positions, variants: dict):
    """Each batch clean, then under each variant: ``(sums {key: (CE, KL)}, tokens,
    summed clean CE)``."""
    sums: dict = {}
    tokens, ce_clean = 0, 0.0
    for batch in batches:
        ce, _, n, clean_logp = next_token_stats(model(**batch).logits, batch)
        tokens += n
        ce_clean += ce
        where = positions(batch)
        for key, variant in variants.items():
            with variant(where):
                ce, kl, _, _ = next_token_stats(model(**batch).logits, batch, clean_logp)
            _add(sums, key, ce, kl)
    return sums, tokens, ce_clean


def _add(sums: dict, key, ce: float, kl: float) -> None:
    ce0, kl0 = sums.get(key, (0.0, 0.0))
    sums[key] = (ce0 + ce, kl0 + kl)


@contextmanager
def swapped_modules(model, modules: Mapping[str, torch.nn.Module]):
    """``model`` with the named submodules replaced by ``modules``, put back on exit."""
    originals = {name: model.get_submodule(name) for name in modules}
    _set_modules(model, modules)
    try:
        yield model
    finally:  # in reverse: a module set inside another one set later is put back last
        _set_modules(model, dict(reversed(originals.items())))


def _set_modules(model, modules: Mapping[str, torch.nn.Module]) -> None:
    for name, module in modules.items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, module)


@contextmanager
def lut_patched(model, lut_dir: str | os.PathLike, *, compensate: int = 0):
    """``model`` with every LUT layer and block of ``lut_dir`` patched in (``patch_model``);
    yields ``{module name: LUT module}`` and puts the original modules back on exit."""
    originals = dict(model.named_modules())
    replaced = patch_model(model, lut_dir, compensate=compensate)
    try:
        yield {name: model.get_submodule(name) for name in replaced}
    finally:
        _set_modules(model, {name: originals[name] for name in replaced})


def _lm_report(
    sums: dict, tokens: int, ce_clean: float, hooks: list, blocks: list, ms: list
) -> dict:
    ce_clean /= tokens

    def figures(key) -> dict:
        """The figures of one hook point or block: each intervention's CE and KL per token,
        the CE loss recovered of each replacement against each ablation."""
        kinds = [kind for kind in ("spliced", "lut", "zero", "mean") if (key, kind) in sums]
        ce = {kind: sums[(key, kind)][0] / tokens for kind in kinds}
        kl = {kind: sums[(key, kind)][1] / tokens for kind in kinds}
        suffix = {"spliced": "", "lut": "_lut"}
        out = {}
        for kind in kinds:
            name = {"zero": "zero_ablated", "mean": "mean_ablated"}.get(kind, kind)
            out[f"ce_{name}"], out[f"kl_{name}"] = ce[kind], kl[kind]
        for kind in ("spliced", "lut"):
            if kind in ce:
                recovered = f"ce_loss_recovered{suffix[kind]}"
                out[recovered] = _recovered(ce["zero"], ce[kind], ce_clean)
                out[recovered + "_mean"] = _recovered(ce["mean"], ce[kind], ce_clean)
        return out

    lut = {}
    for m in ms:
        ce, kl = (v / tokens for v in sums[("lut", m)])
        lut[m] = {"ce": ce, "kl": kl, "ce_increase": ce - ce_clean}
    return {
        "tokens": tokens,
        "ce_clean": ce_clean,
        "hooks": {hook: figures(hook) for hook in hooks},
        "mlp": {block: figures(block) for block in blocks},
        "lut": lut,
    }


def _recovered(ablated: float, spliced: float, clean: float) -> float:
    """(CE_ablated - CE_spliced) / (CE_ablated - CE_clean); NaN when ablating changes
    nothing (the fraction is undefined)."""
    gap = ablated - clean
    return (ablated - spliced) / gap if gap else float("nan")


@torch.no_grad()
def _hook_means(model, batches: list[dict], hooks: dict[str, list[str]], positions) -> dict:
    """Per hook point, the mean activation over the positions interventions touch."""
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    where: dict = {}
    handles = []
    modules = dict(model.named_modules())

    def add(hook, x):
        picked = x[where["now"].to(x.device)].double()
        sums[hook] = sums.get(hook, 0) + picked.sum(0)
        counts[hook] = counts.get(hook, 0) + picked.shape[0]

    for hook in hooks:
        module, _, kind = hook.rpartition(":")
        if kind == "input":
            handles.append(modules[module].register_forward_pre_hook(
                lambda m, args, hook=hook: add(hook, args[0])))  # fmt: skip
        else:
            handles.append(modules[module].register_forward_hook(
                lambda m, args, out, hook=hook: add(hook, out[0] if isinstance(out, tuple) else out)
            ))  # fmt: skip
    try:
        for batch in batches if hooks else ():
            where["now"] = positions(batch)
            model(**batch)
    finally:
        for handle in handles:
            handle.remove()
    return {h: (sums[h] / max(counts[h], 1)).float() for h in hooks}


def evaluate_lm(model_dir: str | os.PathLike, texts: list[str], **kwargs) -> dict:
    """``lm_loss_evaluation`` of the causal LM in ``model_dir`` (loaded offline, as the
    extraction loads it, so hook point names are the extraction's)."""
    from ..extract.model import is_causal_lm, load_model

    if not is_causal_lm(model_dir):
        raise LUTError(f"{model_dir}: not a causal language model; its loss cannot be evaluated")
    tokenizer, model = load_model(model_dir)
    return lm_loss_evaluation(model, tokenizer, texts, **kwargs)
