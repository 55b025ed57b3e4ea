"""Our replacement model and attribution graphs against circuit-tracer's (0.5.0, from
PyPI) on the same toy Llama, the same cross-layer transcoder and the same per-layer
transcoders: logits with every MLP replaced, each layer's replaced output, the features'
activations and error vectors, and each prompt's graph (nodes and edge weights), with
the time per prompt of both.

    python -m benchmarks circuit_tracer
    CIRCUIT_TRACER_RUN=runs/clt CIRCUIT_TRACER_PROMPTS=16 python -m benchmarks circuit_tracer

circuit-tracer pins ``transformers<=4.57.3`` (and ``nnsight``, ``transformer-lens``)
while this project runs transformers 5, so it runs in a venv of its own,
``.venv-circuit-tracer``, which sees ``.venv``'s packages after its own (so its
transformers 4.57.3 shadows ours and torch is ``.venv``'s); ``SETUP`` makes it. This
module runs there as a subprocess (``--theirs DIR``): everything it needs passes through
files in ``DIR``. Without the venv only the reason is printed.

The dictionaries: the CLT of a ``./dev demo --config conf/pipeline-clt.toml`` run
(``CIRCUIT_TRACER_RUN``, default ``runs/clt`` where it exists: 4 layers, 256 latents per
layer, its JumpReLU thresholds as the trainer calibrated them) and, as the per-layer set,
that CLT's ``l -> l`` decoders alone (the demo's own per-layer transcoders are TopK and
have no thresholds; circuit-tracer's transcoders are JumpReLU or ReLU only). Without a
demo run: the tiny toy Llama (``TINY``) and a random CLT whose thresholds keep about
``K`` latents per layer and token. Both sides encode ``pre * 1[pre > threshold]``
(circuit-tracer's only rule; ours ``rule="threshold"``).

circuit-tracer runs on both its backends. nnsight: ``ReplacementModel.from_pretrained_and_
transcoders(dir, transcoders, backend="nnsight")`` takes any local Hugging Face Llama.
TransformerLens: the same call fails on a local model (``HookedTransformer.from_pretrained``
first looks the name up in TransformerLens's list of official models and raises
``ValueError: <dir> not found. Valid official model names ...``), so the model is built as
that call builds it, from the config and weights TransformerLens's own loaders read from
the directory (``_their_model``). The model directory is copied for transformers 4.57.3
(``for_transformers_4``). The prompts (held-out demo passages, ``TOKENS`` tokens, BOS
first) are given to both as token ids: circuit-tracer's own tokenization would put
``<|eos|>`` first, not BOS (its ``ensure_tokenized`` picks the first special id that is
truthy, and the toy's BOS id is 0).

What is compared (ours minus theirs, max abs; rel = max abs / max |ours|):
- logits with every MLP replaced at every position (ours ``circuits.ReplacementModel``;
  theirs its replacement model with each MLP's output set to its transcoders' output on
  the run's own MLP input: an nnsight trace, or TransformerLens hooks), and each layer's
  replaced output on that run;
- on the clean run: feature activations (theirs ``get_activations``) and error vectors
  (theirs ``setup_attribution``) at positions >= 1 -- circuit-tracer zeroes both at
  position 0 (BOS); our graphs take the same convention (``first_position=False``, the
  default), the replacement model's clean run keeps them;
- graphs (ours ``graphs.attribution.attribute``; theirs ``attribute(ids, model,
  max_n_logits=10, desired_logit_prob=0.95)``, unpruned): the feature nodes (layer, pos,
  latent) at positions >= 1, the logit nodes, and the adjacency over the shared nodes
  (targets: features and logits; sources: features, errors at positions >= 1, tokens),
  node order mapped. Any BOS features and errors of ours would have no counterpart; the
  table gives their share of the absolute edge weight into the shared targets (0 under
  the shared convention);
- partial graphs (``max_feature_nodes`` at ``LIMITS``, both sides at ``PARTIAL_BATCH``
  targets per batch and ``INTERVAL`` batches between re-rankings): the selected features
  and the whole adjacency;
- pruning and scores: our ``graphs.graph.prune`` and ``scores`` run on circuit-tracer's
  own graph against its ``prune_graph`` and ``compute_graph_scores``.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .common import table

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv-circuit-tracer"
PROMPTS, TOKENS, K, N_LATENTS = 8, 24, 4, 64
MAX_LOGITS, LOGIT_PROB = 10, 0.95
LIMITS, PARTIAL_BATCH, INTERVAL = (64, 256), 16, 2
"""Partial attribution: ``max_feature_nodes`` limits, targets per batch, batches between
re-rankings (both sides)."""
HOOK_IN, HOOK_OUT = "mlp.hook_in", "mlp.hook_out"
DICTS = ("clt", "per_layer")
SIDES = tuple(f"{b}:{k}" for b in ("nnsight", "transformerlens") for k in DICTS)
"""circuit-tracer's runs: backend and dictionary."""

SETUP = """\
python -m venv .venv-circuit-tracer
echo "import site; site.addsitedir('$PWD/.venv/lib/python3.11/site-packages')" \\
  > .venv-circuit-tracer/lib/python3.11/site-packages/main-venv.pth
# its own pins; torch stays .venv's (already satisfies torch>=2.0: nothing downloaded)
# nnsight 0.6.3: 0.7 and later have no nnsight.intervention.tracing, which circuit-tracer imports
.venv-circuit-tracer/bin/pip install circuit-tracer==0.5.0 transformers==4.57.3 nnsight==0.6.3 \\
  transformer-lens==3.2.1"""


# ---------------------------------------------------------------- our side (.venv)


def for_transformers_4(src: Path, dst: Path) -> Path:
    """A copy of a model directory saved by transformers 5 that transformers 4.57 reads
    as the same model: ``rope_parameters`` back to ``rope_theta`` (4.x ignores the new
    key and would fall back to its default) and the tokenizer's class named as 4.x
    knows it (5.x writes ``TokenizersBackend``)."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    rope = cfg.pop("rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"{src}: rope {rope} has no transformers 4 spelling here")
    cfg["rope_theta"], cfg["rope_scaling"] = rope.get("rope_theta", 10000.0), None
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    tok = json.loads((dst / "tokenizer_config.json").read_text())
    tok.pop("backend", None)
    tok["tokenizer_class"] = "PreTrainedTokenizerFast"
    (dst / "tokenizer_config.json").write_text(json.dumps(tok, indent=2))
    return dst


def _demo_run() -> tuple[Path, Path] | None:
    """(model directory, CLT file) of a CLT demo run, if there is one."""
    run = Path(os.environ.get("CIRCUIT_TRACER_RUN", ROOT / "runs" / "clt"))
    models = sorted((run / "model").glob("toy-llama-*/config.json"))
    clts = sorted(run.glob("clt-*/sae.safetensors"))
    return (models[0].parent, clts[0]) if models and clts else None


def _random_clt(model_dir: Path, out: Path) -> Path:
    """A random CLT over every block of the model at ``model_dir`` whose thresholds keep
    about ``K`` of ``N_LATENTS`` latents per layer and token on demo passages."""
    import torch

    from pyspark_safetensors.extract.corpus import passages_by_key
    from pyspark_safetensors.extract.model import load_model
    from pyspark_safetensors.sae.architectures import CrossLayerTranscoder
    from pyspark_safetensors.sae.checkpoint import save_sae

    tok, model = load_model(model_dir)
    d, L = model.config.hidden_size, model.config.num_hidden_layers
    hooks = [f"model.layers.{i}.mlp:input" for i in range(L)]
    clt = CrossLayerTranscoder(d, N_LATENTS, K, d_out=d, n_layers=L, seed=0, hook_points=hooks,
                               target_hook_points=[h.replace("input", "output") for h in hooks])  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    state = {n: t + 0.1 * torch.randn(t.shape, generator=gen) for n, t in clt.full_state().items()}
    xs = [[] for _ in range(L)]
    handles = [layer.mlp.register_forward_pre_hook(lambda m, a, i=i: xs[i].append(a[0][0]))
               for i, layer in enumerate(model.model.layers)]  # fmt: skip
    with torch.no_grad():
        for text in passages_by_key(0, 1 << 30, 400)[:32]:
            model(**tok(text, return_tensors="pt", truncation=True))
    for h in handles:
        h.remove()
    pre = [torch.cat(x) @ state["encoder_weight"][i].T + state["encoder_bias"][i]
           for i, x in enumerate(xs)]  # fmt: skip
    top = [p.quantile(1 - K / N_LATENTS, dim=0) for p in pre]
    state["threshold"] = torch.stack(top).clamp_min(0)
    clt.load_full_state(state)
    save_sae(out, clt.full_state(), clt.metadata())
    return out


def _diagonal(clt_path: Path, out: Path) -> Path:
    """The CLT at ``clt_path`` with its ``l -> t`` decoders (t > l) zeroed: a per-layer set."""
    from pyspark_safetensors.sae.checkpoint import save_sae
    from pyspark_safetensors.sae.ecosystem import read_sae

    tensors, info = read_sae(clt_path)
    for name, w in tensors.items():
        if name.startswith("decoder_weight."):
            w[:, 1:] = 0
    meta = {k: v if isinstance(v, str) else json.dumps(v) for k, v in info["metadata"].items()}
    save_sae(out, tensors, meta)
    return out


def prepare(root: Path) -> dict:
    """Model, dictionaries (ours and exported) and prompts under ``root``; ``inputs.json``."""
    from pyspark_safetensors.extract.corpus import passages_by_key
    from pyspark_safetensors.extract.model import load_model
    from pyspark_safetensors.extract.toy_lm import TINY, toy_lm
    from pyspark_safetensors.sae.ecosystem import export_sae

    found = _demo_run()
    if found:
        model_dir, clt = found
        run = model_dir.parent.parent.resolve()
        shown = run.relative_to(ROOT) if run.is_relative_to(ROOT) else run.name
        source = f"the toy Llama and CLT of a CLT demo run ({shown})"
    else:
        model_dir = toy_lm(Path(tempfile.gettempdir()) / "pss-bench-toy-lm", TINY)
        clt = _random_clt(model_dir, root / "clt.safetensors")
        source = f"the tiny toy Llama and a random CLT ({N_LATENTS} latents x {K} active)"
    diag = _diagonal(clt, root / "per_layer.safetensors")
    export_sae(clt, root / "ct-clt", "circuit-tracer")
    export_sae(diag, root / "ct-per_layer", "circuit-tracer-transcoders")
    tok, _ = load_model(model_dir)
    n = int(os.environ.get("CIRCUIT_TRACER_PROMPTS", PROMPTS))
    texts = passages_by_key(0, 1 << 30, 400)[-n:]
    prompts = [tok(t, truncation=True, max_length=TOKENS)["input_ids"] for t in texts]
    inputs = {"model": str(model_dir), "model4": str(for_transformers_4(model_dir, root / "model4")),
              "clt": str(clt), "per_layer": str(diag), "prompts": prompts, "source": source}  # fmt: skip
    (root / "inputs.json").write_text(json.dumps(inputs))
    return inputs


def ours(inputs: dict) -> dict:
    """Our figures per dictionary and prompt (tensors by name) and seconds per graph."""
    import torch

    from pyspark_safetensors.circuits import ReplacementModel, clt_replacement
    from pyspark_safetensors.extract.model import load_model
    from pyspark_safetensors.graphs.attribution import AttributionConfig, attribute_local

    _, model = load_model(inputs["model"])
    config = AttributionConfig(max_logits=MAX_LOGITS, logit_probability=LOGIT_PROB)
    out, seconds = {}, {}
    for kind in DICTS:
        rep = clt_replacement(model, inputs[kind], rule="threshold")
        if kind == "per_layer":  # the CLT with its l -> t decoders zeroed: the l -> l case
            rep.decoders = [{t: d[t]} for t, d in enumerate(rep.decoders)]
        rm, times, blocks = ReplacementModel(model, rep), [], rep.blocks
        for i, ids in enumerate(inputs["prompts"]):
            ids = torch.tensor(ids)
            started = time.perf_counter()
            local = rm.capture(ids, first_position=False)
            graph = attribute_local(local, config)
            times.append(time.perf_counter() - started)
            run = rm.forward({"input_ids": ids[None]}, record=True)
            key = f"{kind}.{i}."
            out[key + "logits"] = run.logits[0]
            out[key + "clean_logits"] = local.logits
            out[key + "outputs"] = torch.stack([run.trace.replaced[b][0] for b in blocks])
            out[key + "codes"] = torch.stack([local.codes[j] for j in range(len(blocks))])
            out[key + "errors"] = local.errors
            out[key + "graph"] = graph
            for limit in LIMITS:
                partial = AttributionConfig(MAX_LOGITS, LOGIT_PROB, PARTIAL_BATCH, limit, INTERVAL)
                out[f"{key}partial{limit}"] = attribute_local(local, partial)
        seconds[kind] = times
    return {"tensors": out, "seconds": seconds}


# ---------------------------------------------------------------- their side (.venv-circuit-tracer)


def _their_transcoders(inputs: dict, kind: str):
    """Our export read by circuit-tracer's own loaders (everything in memory)."""
    import torch
    from circuit_tracer.transcoder.cross_layer_transcoder import load_clt
    from circuit_tracer.transcoder.single_layer_transcoder import load_transcoder_set

    cpu, where = torch.device("cpu"), Path(inputs["root"]) / f"ct-{kind}"
    if kind == "clt":
        return load_clt(str(where), feature_input_hook=HOOK_IN, feature_output_hook=HOOK_OUT,
                        device=cpu, dtype=torch.float32, lazy_decoder=False)  # fmt: skip
    files = sorted(where.glob("layer_*.safetensors"), key=lambda p: int(p.stem[6:]))
    return load_transcoder_set({i: str(p) for i, p in enumerate(files)}, "ours", HOOK_IN,
                               HOOK_OUT, device=cpu, dtype=torch.float32,
                               lazy_encoder=False, lazy_decoder=False)  # fmt: skip


def _their_model(inputs: dict, tc, backend: str):
    """circuit-tracer's ReplacementModel of the copied model. nnsight: its
    ``from_pretrained_and_transcoders``. TransformerLens: what that function does (a
    ``HookedTransformer`` without folding or centring, then ``_configure_replacement_model``)
    with the config and weights TransformerLens's loaders read from the local directory,
    since its ``HookedTransformer.from_pretrained`` accepts only official model names."""
    import torch
    from circuit_tracer import ReplacementModel

    cpu, f32 = torch.device("cpu"), torch.float32
    if backend == "nnsight":
        return ReplacementModel.from_pretrained_and_transcoders(
            inputs["model4"], tc, backend="nnsight", device=cpu, dtype=f32
        )
    from circuit_tracer.replacement_model.replacement_model_transformerlens import (
        TransformerLensReplacementModel,
    )
    from transformer_lens import loading_from_pretrained as loading
    from transformers import AutoTokenizer

    path = inputs["model4"]
    cfg = loading.get_pretrained_model_config(path, dtype=f32, device="cpu", fold_ln=False)
    model = TransformerLensReplacementModel(cfg, tokenizer=AutoTokenizer.from_pretrained(path))
    model.load_and_process_state_dict(loading.get_pretrained_state_dict(path, cfg, None, dtype=f32),
                                      fold_ln=False, center_writing_weights=False,
                                      center_unembed=False)  # fmt: skip
    model._configure_replacement_model(tc)
    return model


def _their_decode(tc, kind: str, t: int, codes: list):
    """Layer ``t``'s output from the codes of layers 0..t, with circuit-tracer's tensors."""
    if kind == "per_layer":
        return tc[t].decode(codes[t])
    y = tc.b_dec[t]
    for s in range(t + 1):
        y = y + codes[s] @ tc._get_decoder_vectors(s)[:, t - s]
    return y


def _their_replaced(model, tc, kind: str, ids, backend: str):
    """Logits and per-layer outputs with every MLP replaced: each MLP's output set to the
    transcoders' output on the run's own MLP input (an nnsight trace, or TransformerLens
    hooks on the feature input and output hook points)."""
    import torch

    codes, outs = [], []
    if backend == "nnsight":
        from nnsight import save

        with torch.no_grad(), model.trace(ids):
            for t in range(model.cfg.n_layers):
                codes.append(tc.encode_layer(model.get_feature_input_loc(t).output, t))
                y = _their_decode(tc, kind, t, codes)
                model.get_feature_output_loc(t).output = y
                outs.append(save(y))
            logits = save(model.output.logits)
    else:

        def read(acts, hook, t):
            codes.append(tc.encode_layer(acts, t))

        def write(acts, hook, t):
            outs.append(_their_decode(tc, kind, t, codes))
            return outs[-1]

        hooks = [h for t in range(model.cfg.n_layers) for h in (
            (f"blocks.{t}.{model.feature_input_hook}", lambda a, hook, t=t: read(a, hook, t)),
            (f"blocks.{t}.{model.original_feature_output_hook}", lambda a, hook, t=t: write(a, hook, t)),
        )]  # fmt: skip
        with torch.no_grad():
            logits = model.run_with_hooks(ids[None], fwd_hooks=hooks)
    return logits[0], torch.stack([o.reshape(len(ids), -1) for o in outs])


def _their_graph(g) -> dict:
    """What is compared of one of circuit-tracer's graphs, with its pruning and scores."""
    import torch
    from circuit_tracer.graph import compute_graph_scores, prune_graph

    pruned = prune_graph(g)
    return {
        "adjacency": g.adjacency_matrix, "features": g.active_features,
        "activations": g.activation_values, "selected": g.selected_features,
        "logit_ids": torch.tensor([t.vocab_idx for t in g.logit_targets]),
        "logit_probs": g.logit_probabilities, "tokens": g.input_tokens,
        "node_mask": pruned.node_mask, "edge_mask": pruned.edge_mask,
        "scores": torch.tensor(compute_graph_scores(g), dtype=torch.float64),
    }  # fmt: skip


def theirs(root: Path) -> None:
    """Run circuit-tracer on ``root/inputs.json``'s prompts with each backend and
    dictionary; write ``theirs.pt`` (tensors keyed ``backend:kind.i.name``)."""
    from importlib import metadata

    import torch
    from circuit_tracer import attribute

    inputs = {**json.loads((root / "inputs.json").read_text()), "root": str(root)}
    out, seconds = {}, {}
    for side in SIDES:
        backend, kind = side.split(":")
        tc = _their_transcoders(inputs, kind)
        model, times = _their_model(inputs, tc, backend), []
        for i, ids in enumerate(inputs["prompts"]):
            ids, key = torch.tensor(ids), f"{side}.{i}."
            started = time.perf_counter()
            g = attribute(ids, model, max_n_logits=MAX_LOGITS, desired_logit_prob=LOGIT_PROB)
            times.append(time.perf_counter() - started)
            out[key + "graph"] = _their_graph(g)
            for limit in LIMITS:
                g = attribute(ids, model, max_n_logits=MAX_LOGITS, desired_logit_prob=LOGIT_PROB,
                              batch_size=PARTIAL_BATCH, max_feature_nodes=limit,
                              update_interval=INTERVAL)  # fmt: skip
                out[f"{key}partial{limit}"] = {
                    "adjacency": g.adjacency_matrix,
                    "features": g.active_features[g.selected_features],
                }
            out[key + "logits"], out[key + "outputs"] = _their_replaced(
                model, tc, kind, ids, backend
            )
            out[key + "clean_logits"], out[key + "codes"] = model.get_activations(ids)
            out[key + "errors"] = model.setup_attribution(ids).error_vectors
        seconds[side] = times
    names = ("circuit-tracer", "nnsight", "transformer-lens", "transformers", "torch")
    versions = {name.replace("-", "_"): metadata.version(name) for name in names}
    torch.save({"tensors": out, "seconds": seconds, "versions": versions}, root / "theirs.pt")


# ---------------------------------------------------------------- comparison (.venv)


def _diff(a, b) -> tuple[float, float]:
    """(max |a - b|, that over max |a|)."""
    a, b = a.float(), b.float().reshape(a.shape)
    worst = float((a - b).abs().max()) if a.numel() else 0.0
    return worst, worst / max(float(a.abs().max()) if a.numel() else 0.0, 1e-30)


def _graph_rows(ours_g, their: dict) -> dict:
    """Nodes and edges of one prompt's two graphs over the shared nodes (module doc)."""
    import numpy as np
    import torch

    L, P = ours_g.n_blocks, ours_g.n_pos
    mine = list(zip(ours_g.feature_layer.tolist(), ours_g.feature_pos.tolist(),
                    ours_g.feature_latent.tolist(), strict=True))  # fmt: skip
    theirs_f = [tuple(r) for r in their["features"].tolist()]
    F, Ft, Kl = len(mine), len(theirs_f), len(ours_g.logit_tokens)
    keep = [i for i, f in enumerate(mine) if f[1] >= 1]
    same_features = [mine[i] for i in keep] == theirs_f
    same_logits = ours_g.logit_tokens.tolist() == their["logit_ids"].tolist()
    r = {"features": (len(keep), Ft), "bos_features": F - len(keep),
         "same_features": same_features, "same_logits": same_logits}  # fmt: skip
    if not (same_features and same_logits):
        return r
    err = [F + b * P + p for b in range(L) for p in range(1, P)]
    terr = [Ft + b * P + p for b in range(L) for p in range(1, P)]
    tok = list(range(F + L * P, F + L * P + P))
    ttok = list(range(Ft + L * P, Ft + L * P + P))
    logit = list(range(F + (L + 1) * P, F + (L + 1) * P + Kl))
    tlogit = list(range(Ft + (L + 1) * P, Ft + (L + 1) * P + Kl))
    rows, trows = keep + logit, list(range(Ft)) + tlogit
    cols, tcols = keep + err + tok, list(range(Ft)) + terr + ttok
    a = torch.from_numpy(ours_g.adjacency)
    mine_a, their_a = a[rows][:, cols], their["adjacency"][trows][:, tcols]
    r["edges"] = _diff(mine_a, their_a)
    r["activations"] = _diff(torch.from_numpy(ours_g.activations[keep]), their["activations"])
    bos = [i for i in range(F) if mine[i][1] == 0] + [F + b * P for b in range(L)]
    total = float(a[rows].abs().sum())
    r["bos_share"] = float(a[rows][:, bos].abs().sum()) / total if total else 0.0
    r["probs"] = float(np.abs(ours_g.logit_probabilities - their["logit_probs"].numpy()).max())
    r.update(_pruning(ours_g, their))
    return r


def _pruning(ours_g, their: dict) -> dict:
    """Our ``prune`` and ``scores`` run on circuit-tracer's graph against its
    ``prune_graph`` and ``compute_graph_scores`` (mismatched node and edge masks, score
    differences), and the scores of each side's own graph."""
    import numpy as np

    from pyspark_safetensors.graphs.graph import AttributionGraph, prune, scores

    f, a = their["features"].numpy(), their["adjacency"].numpy()
    graph = AttributionGraph(
        prompt="", tokens=their["tokens"].numpy(), feature_layer=f[:, 0], feature_pos=f[:, 1],
        feature_latent=f[:, 2], activations=their["activations"].numpy(),
        n_blocks=ours_g.n_blocks, logit_tokens=their["logit_ids"].numpy(),
        logit_probabilities=their["logit_probs"].numpy(), adjacency=a,
        values=np.zeros(len(a)), bias=np.zeros(len(a)),
    )  # fmt: skip
    mine = prune(graph)
    return {
        "node_mask": int((mine.node_mask != their["node_mask"].numpy()).sum()),
        "edge_mask": int((mine.edge_mask != their["edge_mask"].numpy()).sum()),
        "kept": (int(mine.node_mask.sum()), int(mine.edge_mask.sum())),
        "score_diff": float(np.abs(np.array(scores(graph)) - their["scores"].numpy()).max()),
        "own_scores": (scores(ours_g), tuple(their["scores"].tolist())),
    }


def _getter(run: dict, key: str, i: int):
    """``name -> run's tensor key.i.name``."""
    return lambda name: run["tensors"][f"{key}.{i}.{name}"]


def compare(mine: dict, their: dict, n: int) -> dict:
    """Per dictionary: the worst differences over the prompts."""
    out = {}
    for side in SIDES:
        kind, acc = side.split(":")[1], {"graphs": []}
        for i in range(n):
            m, t = _getter(mine, kind, i), _getter(their, side, i)
            for name in ("logits", "outputs", "clean_logits"):
                acc.setdefault(name, []).append(_diff(m(name), t(name)))
            for name in ("codes", "errors"):  # positions >= 1: theirs are zero at BOS
                acc.setdefault(name, []).append(_diff(m(name)[:, 1:], t(name)[:, 1:]))
            acc.setdefault("scale", []).append(_diff(m("clean_logits"), m("logits")))
            acc["graphs"].append(_graph_rows(m("graph"), t("graph")))
        out[side] = acc
    return out


def _partial(mine: dict, their: dict, n: int) -> list[list]:
    """Per backend, dictionary and limit: prompts whose selected features are equal, and
    the worst edge difference over the graphs (max abs / relative to max |ours|)."""
    import torch

    rows = []
    for side in SIDES:
        kind = side.split(":")[1]
        for limit in LIMITS:
            same, diffs = 0, []
            for i in range(n):
                g = mine["tensors"][f"{kind}.{i}.partial{limit}"]
                t = their["tensors"][f"{side}.{i}.partial{limit}"]
                ours_f = list(zip(g.feature_layer.tolist(), g.feature_pos.tolist(),
                                  g.feature_latent.tolist(), strict=True))  # fmt: skip
                if ours_f == [tuple(r) for r in t["features"].tolist()]:
                    same += 1
                    diffs.append(_diff(torch.from_numpy(g.adjacency), t["adjacency"]))
            rows.append([*side.split(":")[::-1], limit, f"{same}/{n}",
                         _worst(diffs) if diffs else "-"])  # fmt: skip
    return rows


def _worst(pairs) -> str:
    return f"{max(p[0] for p in pairs):.1e} / {max(p[1] for p in pairs):.1e}"


def _output_row(side: str, acc: dict) -> list:
    names = ("clean_logits", "scale", "logits", "outputs", "codes", "errors")
    return [*side.split(":")[::-1], *(_worst(acc[name]) for name in names)]


def _graph_row(side: str, acc: dict, n: int, seconds: tuple) -> list:
    gs = acc["graphs"]
    ok = [g for g in gs if "edges" in g]
    mean = lambda f: sum(map(f, ok)) / max(1, len(ok))  # noqa: E731
    own = [(g["own_scores"][0][i], g["own_scores"][1][i]) for g in ok for i in (0, 1)]
    return [
        *side.split(":")[::-1], f"{sum(g['same_features'] and g['same_logits'] for g in gs)}/{n}",
        f"{mean(lambda g: g['features'][0]):.0f} (+{mean(lambda g: g['bos_features']):.0f})",
        _worst([g["edges"] for g in ok]) if ok else "-",
        f"{max(g['bos_share'] for g in ok):.4f}" if ok else "-",
        f"{sum(g['node_mask'] for g in ok)} / {sum(g['edge_mask'] for g in ok)}",
        f"{max(g['score_diff'] for g in ok):.1e}" if ok else "-",
        f"{max(abs(a - b) for a, b in own):.1e}" if own else "-",
        *(f"{statistics.median(s):.2f}" for s in seconds),
    ]  # fmt: skip


def report(inputs: dict, mine: dict, their: dict, load: str) -> str:
    """The section: outputs table, graphs table, and how they were made."""
    n = len(inputs["prompts"])
    res = compare(mine, their, n)
    outputs = table(["dictionary", "backend", "clean logits", "(ours: replaced vs clean)", "replaced logits",
                     "replaced layer outputs", "activations (pos >= 1)", "errors (pos >= 1)"],
                    [_output_row(kind, acc) for kind, acc in res.items()])  # fmt: skip
    graphs = table(["dictionary", "backend", "same nodes", "features per graph (+ ours at BOS)",
                    "edges", "BOS share", "prune on its graph: node / edge mismatches",
                    "scores on its graph", "own graphs' scores", "ours s/graph",
                    "circuit-tracer s/graph"],
                   [_graph_row(side, acc, n, (mine["seconds"][side.split(":")[1]],
                                              their["seconds"][side])) for side, acc in res.items()])  # fmt: skip
    partial = table(["dictionary", "backend", "max_feature_nodes", "same selected features",
                     "edges"], _partial(mine, their, n))  # fmt: skip
    v = their["versions"]
    return (
        f"## Against circuit-tracer: {n} prompts of {TOKENS} tokens, {inputs['source']}\n\n"
        + outputs + "\n\n" + graphs
        + "\n\nPartial attribution (both sides: batch size "
        f"{PARTIAL_BATCH}, update_interval {INTERVAL}; edges over the whole adjacency):\n\n"
        + partial
        + "\n\nDifferences: max abs / (max abs over max |ours|), worst prompt; positions >= 1 "
        "where circuit-tracer zeroes BOS. \"ours: replaced vs clean\": how far the replaced "
        "model's logits are from the clean model's (the scale of the comparison). \"BOS "
        "share\": the share of the absolute edge weight into the shared targets that comes "
        "from our BOS features and errors (none: both sides leave position 0 without nodes, "
        "circuit-tracer's convention). \"prune on its "
        "graph\" and \"scores on its graph\": our graphs.prune and graphs.scores run on "
        "circuit-tracer's own graph against its prune_graph and compute_graph_scores; \"own "
        "graphs' scores\": each side's (replacement, completeness) on its own graph. "
        "Command: python -m benchmarks circuit_tracer (circuit-tracer runs as a subprocess in "
        "its venv). circuit-tracer "
        f"{v['circuit_tracer']} (nnsight {v['nnsight']}, transformer-lens {v['transformer_lens']}, "
        f"transformers {v['transformers']}, torch {v['torch']}) in .venv-circuit-tracer; "
        "unpruned graphs, max_n_logits "
        f"{MAX_LOGITS}, desired_logit_prob {LOGIT_PROB}, each side's default batch size (ours 64 "
        f"targets per backward pass, circuit-tracer 512); seconds per graph: median over the "
        f"prompts; load average before the run: {load}."
    )  # fmt: skip


def run() -> str:
    python = VENV / "bin" / "python"
    if not python.exists():
        return ("## Against circuit-tracer\n\nNot run: no .venv-circuit-tracer (circuit-tracer "
                f"pins transformers<=4.57.3). Make it with:\n\n```\n{SETUP}\n```")  # fmt: skip
    import torch

    load = f"{os.getloadavg()[0]:.2f}"
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        inputs = prepare(root)
        mine = ours(inputs)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        subprocess.run([str(python), "-m", "benchmarks.bench_circuit_tracer", "--theirs", tmp],
                       cwd=ROOT, check=True, env=env)  # fmt: skip
        their = torch.load(root / "theirs.pt", weights_only=False)
    return report(inputs, mine, their, load)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--theirs"]:
        theirs(Path(sys.argv[2]))
    else:
        print(run())
