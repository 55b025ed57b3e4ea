"""``report.md``: the pipeline's figures as a researcher would show them, rendered from
``summary.json`` (the same numbers, machine-readable)."""

from __future__ import annotations

import json


def _table(header: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return out


def render_report(summary: dict) -> str:
    """The markdown report of one pipeline run."""
    sections = (_overview, _stages, _extraction, _saes, _transcoders, _crosscoders, _lm_loss,
                _mlp_replacement, _whole_network, _graphs, _global_weights, _classifier, _probing, _lut_errors, _lut_latency, _mlp_latency,
                _embeddings, _features, _configuration)  # fmt: skip
    return "\n".join(line for section in sections for line in section(summary))


def _overview(summary: dict) -> list[str]:
    c, ev = summary["config"], summary["evaluation"]
    if "held_out_images" in ev:
        corpus = (f"{c['images']} training images, {ev['held_out_images']} held-out images "
                  "the model never saw")  # fmt: skip
    else:
        corpus = (f"{c['texts']} training passages, {ev['held_out_texts']} held-out passages "
                  "never seen by any stage")  # fmt: skip
    return [
        "# Pipeline report",
        "",
        f"Model `{summary['source_model']}`; {corpus}; "
        f"SAEs trained on {c['nproc']} process(es) ({c['parallel']} parallel). "
        f"Created {summary['created_at']}, {summary['seconds']:.0f} s in all.",
        "",
        *_toy_lm(summary),
        *_toy_vit(summary),
    ]


def _toy_vit(summary: dict) -> list[str]:
    """The toy ViT the run trained, when it trained one."""
    t = summary.get("toy_vit")
    if not t:
        return []
    c = t["config"]
    return [
        f"The model is a toy ViT trained by the pipeline's `model` stage to tell the {t['task']} "
        f"of synthetic images ({', '.join(t['labels'])}): {t['parameters']:,} parameters "
        f"({c['num_layers']} layers, hidden {c['hidden_size']}, {c['image_size']}-pixel images "
        f"in patches of {c['patch_size']}), {c['steps']} steps; held-out accuracy "
        f"{t['held_out_accuracy']:.1%} against {t['chance_accuracy']:.1%} by chance.",
        "",
    ]


def _toy_lm(summary: dict) -> list[str]:
    """The toy Llama the run trained, when it trained one."""
    t = summary.get("toy_lm")
    if not t:
        return []
    c = t["config"]
    return [
        f"The model is a toy Llama trained by the pipeline's `model` stage: {t['parameters']:,} "
        f"parameters ({c['num_layers']} layers, hidden {c['hidden_size']}, vocabulary "
        f"{c['vocab_size']}), {c['steps']} steps; held-out next-token loss "
        f"{t['held_out_loss']:.3f} nats against {t['unigram_held_out_loss']:.3f} for a "
        "unigram model. The evaluation's held-out passages are the model's own, never "
        "trained on.",
        "",
    ]


def _stages(summary: dict) -> list[str]:
    rows = [
        [n, f"`{s['dir']}`", f"`{s['hash']}`", "yes" if s.get("reused") else "no"]
        for n, s in summary["stages"].items()
    ]
    return ["## Stages", "", *_table(["stage", "output", "config hash", "reused"], rows), ""]


def _extraction(summary: dict) -> list[str]:
    ex = summary["extraction"]
    if ex.get("modality") == "image":
        return [
            "## Extraction",
            "",
            f"{ex['texts']:,} images → {ex['tokens']:,} tokens per hook point (CLS and every "
            f"patch), {ex['bytes'] / 1e9:.3f} GB, {ex['texts'] / max(ex['seconds'], 1e-9):,.1f} "
            f"images/s ({ex['seconds']:.1f} s); our datasets and a saev dump (`saev/`).",
            "",
        ]
    return [
        "## Extraction",
        "",
        f"{ex['texts']:,} texts → {ex['samples']:,} model inputs, {ex['tokens']:,} tokens per "
        f"hook point, {ex['bytes'] / 1e9:.3f} GB, {ex['tokens_per_s']:,.0f} tokens/s "
        f"({ex['seconds']:.1f} s).",
        "",
    ]


def _saes(summary: dict) -> list[str]:
    ev = summary["evaluation"]
    lines = [
        "## SAEs",
        "",
        "Training figures are the last logged step; held-out figures are measured on the "
        + (
            "held-out images' tokens (each SAE's own: the patches, or the CLS token)"
            if "held_out_images" in ev
            else "held-out passages' tokens"
        )
        + " with the trained encoding.",
        "",
    ]
    rows = []
    for hook, t in _trained(summary, "sae").items():
        h = ev["sae"][hook]
        rows.append([
            f"`{hook}`", f"{h['num_latents']} / k={h['k']}", f"{t['fvu']:.4f}", f"{h['fvu']:.4f}",
            f"{t['l0']:.1f}", f"{h['l0']:.1f}", f"{t['dead_fraction']:.1%}",
            f"{h['dead_fraction']:.1%}", f"{h['dense_fraction']:.1%}",
            f"{t.get('tokens_per_s', 0):,.0f}",
        ])  # fmt: skip
    if not rows:  # no SAE on a hook point (a run of transcoders only): the plot alone
        return [f"![latent frequency]({summary['evaluation_dir']}/latent_frequency.png)", ""]
    lines += _table(
        ["hook point", "latents / k", "FVU (train)", "FVU (held-out)", "L0 (train)", "L0 (held-out)",
         "dead (train)", "never fired (held-out)", "dense >10% (held-out)", "tokens/s"],
        rows,
    )  # fmt: skip
    lines += [""]
    for hook in _trained(summary, "sae"):
        lines += [f"![training {hook}]({summary['sae_runs'][hook]}/training.png)", ""]
    return [*lines, f"![latent frequency]({summary['evaluation_dir']}/latent_frequency.png)", ""]


def _trained(summary: dict, kind: str) -> dict:
    """The training figures of the runs of one kind ("sae" where a summary names none)."""
    return {n: t for n, t in summary["training"].items() if t.get("kind", "sae") == kind}


def _transcoders(summary: dict) -> list[str]:
    """Each transcoder's figures: the FVU of its target, L0, dead latents."""
    runs = _trained(summary, "transcoder")
    if not runs:
        return []
    ev = summary["evaluation"]["transcoders"]
    rows = []
    for block, t in runs.items():
        h = ev[block]
        rows.append([
            f"`{block}`", f"`{h['input']}` → `{h['target']}`", f"{h['num_latents']} / k={h['k']}",
            f"{t['fvu']:.4f}", f"{h['fvu']:.4f}", f"{h['l0']:.1f}", f"{h['dead_fraction']:.1%}",
            f"{t.get('tokens_per_s', 0):,.0f}",
        ])  # fmt: skip
    lines = [
        "## Transcoders",
        "",
        "A transcoder reads its input hook point and reconstructs its target (the block's "
        "output): the FVU is the target's. Held-out figures on the held-out passages' tokens.",
        "",
        *_table(
            [
                "block",
                "input → target",
                "latents / k",
                "FVU (train)",
                "FVU (held-out)",
                "L0 (held-out)",
                "never fired (held-out)",
                "tokens/s",
            ],
            rows,
        ),
        "",
    ]
    for block in runs:
        lines += [f"![training {block}]({summary['sae_runs'][block]}/training.png)", ""]
    return lines


def _crosscoders(summary: dict) -> list[str]:
    """Each crosscoder's FVU over all its hook points and per hook point, beside the hook
    point's own SAE."""
    runs = _trained(summary, "crosscoder")
    if not runs:
        return []
    ev = summary["evaluation"]["crosscoders"]
    lines = [
        "## Crosscoders",
        "",
        "One code read from every hook point of the set, a decoder per hook point; each hook "
        "point's held-out FVU beside that of the hook point's own SAE (when the run trained "
        "one; its latents in brackets).",
        "",
    ]
    rows = []
    for name in runs:
        h = ev[name]
        rows.append([f"`{name}` (all)", f"{h['num_latents']} / k={h['k']}", f"{h['fvu']:.4f}",
                     "", f"{h['l0']:.1f}", f"{h['dead_fraction']:.1%}"])  # fmt: skip
        for hook in h["hooks"]:
            own = h["sae_fvu"].get(hook)
            sae = f"{own:.4f} ({h['sae_latents'][hook]})" if own is not None else ""
            rows.append([f"`{hook}`", "", _num(h.get(f"fvu_{hook}"), ".4f"), sae, "", ""])
    lines += _table(["crosscoder / hook point", "latents / k", "FVU (held-out)",
                     "its SAE's FVU", "L0", "never fired"], rows)  # fmt: skip
    return [*lines, ""]


def _mlp_replacement(summary: dict) -> list[str]:
    """A causal LM's loss with each MLP block replaced whole by its transcoder and LUT."""
    lm = summary["evaluation"].get("lm_loss") or {}
    if not lm.get("mlp"):
        return []
    rows = []
    for block, h in lm["mlp"].items():
        rows.append([
            f"`{block}`", _num(h.get("ce_spliced"), ".4f"), _num(h.get("ce_lut"), ".4f"),
            f"{h['ce_zero_ablated']:.4f}", f"{h['ce_mean_ablated']:.4f}",
            f"**{_num(h.get('ce_loss_recovered'), '.3f')}**",
            _num(h.get("ce_loss_recovered_mean"), ".3f"), _num(h.get("ce_loss_recovered_lut"), ".3f"),
            _num(h.get("kl_spliced"), ".3g"), _num(h.get("kl_lut"), ".3g"),
        ])  # fmt: skip
    return [
        "## MLP blocks replaced whole",
        "",
        "Each block's output replaced at every real token by its transcoder's output from the "
        "block's input (transcoder), by the block's LUT (LUT, at every position, as in use), by "
        "zeros or by its mean; CE loss recovered against zero (and mean) ablation, KL to the "
        f"clean next-token distributions (clean CE {lm['ce_clean']:.4f}).",
        "",
        *_table(
            [
                "block",
                "CE transcoder",
                "CE LUT",
                "CE zero-abl.",
                "CE mean-abl.",
                "CE loss recovered",
                "recovered vs mean",
                "recovered (LUT)",
                "KL transcoder",
                "KL LUT",
            ],
            rows,
        ),
        "",
    ]


_REPLACEMENTS = {"clt": "CLT", "clt_threshold": "CLT, thresholds", "clt_lut": "CLT's LUT",
                 "per_layer": "per-layer transcoders",
                 "per_layer_lut": "per-layer transcoders' LUT"}  # fmt: skip


def _whole_network(summary: dict) -> list[str]:
    """Each cross-layer transcoder's replacement model: every MLP replaced at once by the
    CLT, its whole-model LUT and the per-layer transcoders (and theirs)."""
    lines = []
    for name, ev in (summary.get("circuits") or {}).items():
        latents = ev.get("latents", {})
        rows = [
            [_REPLACEMENTS.get(model, model), latents.get(model, {}).get("total", ""),
             f"{m['ce']:.4f}", f"**{_num(m['ce_loss_recovered'], '.3f')}**",
             _num(m["ce_loss_recovered_mean"], ".3f"), f"{m['kl']:.4f}", f"{m['top1']:.3f}"]
            for model, m in ev["models"].items()
        ]  # fmt: skip
        t = (summary.get("training") or {}).get(name, {})
        per_layer = [t[k] for k in sorted((k for k in t if k.startswith("fvu_layer")),
                                          key=lambda k: int(k.removeprefix("fvu_layer")))]  # fmt: skip
        trained = (
            [f"The CLT's last training step: FVU per layer {', '.join(f'{v:.4f}' for v in per_layer)}; "
             f"L0 {t['l0']:.1f} over all layers; dead {t['dead_fraction']:.1%}.", ""]
            if per_layer else []
        )  # fmt: skip
        fvu_rows = [
            [f"`{block}`", *(f"{m['fvu_replaced'][block]:.3f} / {m['fvu_clean'][block]:.3f}"
                             for m in ev["models"].values())]
            for block in ev["blocks"]
        ]  # fmt: skip
        lines += [
            f"## The whole network replaced: CLT `{name}`",
            "",
            f"Every MLP block ({len(ev['blocks'])}) replaced at once, each block's output the "
            "replacement's from the MLP inputs the replaced model itself produces (errors "
            f"compound), on {ev['tokens']} held-out next tokens (in `{ev['dir']}`). Clean CE "
            f"{ev['ce_clean']:.4f}; every MLP zero-ablated {ev['ce_zero_ablated']:.4f} (KL "
            f"{ev['kl_zero_ablated']:.3f}, top-1 {ev['top1_zero_ablated']:.3f}), mean-ablated "
            f"{ev['ce_mean_ablated']:.4f} (KL {ev['kl_mean_ablated']:.3f}, top-1 "
            f"{ev['top1_mean_ablated']:.3f}). CE loss recovered against zero (and mean) "
            "ablation, KL to the clean next-token distributions (nats per token), top-1: the "
            "share of tokens whose most likely next token is the clean model's. The CLT, its "
            "LUT and the transcoders keep the top k per layer per token (the trained code); "
            '"CLT, thresholds" fires each latent above its JumpReLU threshold from the file '
            "(what circuit-tracer runs from an export; `docs/sae.md`, the threshold rule).",
            "",
            *_table(
                [
                    "replacement",
                    "latents",
                    "CE",
                    "CE loss recovered",
                    "recovered vs mean",
                    "KL",
                    "top-1",
                ],
                rows,
            ),
            "",
            *trained,
            "FVU of each block's output, in the replaced run (against the block's own output on "
            "the inputs the replaced model gives it) / in the clean run (from clean inputs):",
            "",
            *_table(["block", *(_REPLACEMENTS.get(m, m) for m in ev["models"])], fvu_rows),
            "",
        ]
    return lines


_DICTIONARIES = {"clt": "CLT", "per_layer": "per-layer transcoders"}


def _graphs(summary: dict) -> list[str]:
    """The graphs stage: each dictionary's graph browser, its prompts' replacement and
    completeness scores (mean, min) and every prompt it refused, by name."""
    g = summary.get("graphs")
    if not g:
        return []
    rows, refused = [], []
    for name, f in g["dictionaries"].items():
        index = f"{g['dir']}/{name}/index.html"
        s = f["scores"]
        rows.append([
            f"{_DICTIONARIES.get(name, name)}", f.get("rule", "topk"), f"[{index}]({index})",
            f"{f['graphs']} / {f['prompts']}", f"{_num(s['replacement']['mean'], '.3f')} / {_num(s['replacement']['min'], '.3f')}",
            f"{_num(s['completeness']['mean'], '.3f')} / {_num(s['completeness']['min'], '.3f')}",
        ])  # fmt: skip
        refused += [f"- {_DICTIONARIES.get(name, name)}, prompt {e['prompt_id']} "
                    f"({json.dumps(_clip(e['prompt']))}): {e['error']}" for e in f["errors"]]  # fmt: skip
    shots = [f"![graph browser ({_DICTIONARIES.get(n, n)})]({g['dir']}/{n}/graph-browser.png)"
             for n, f in g["dictionaries"].items() if f.get("screenshot")]  # fmt: skip
    return [
        f"## Attribution graphs: CLT `{g['clt']}`",
        "",
        "Each prompt's attribution graph in its local replacement model (attention patterns "
        "and normalisation frozen, an error node per block and position; docs/graphs.md), "
        "computed in Spark. The replacement score is the share of the influence on the output "
        "that comes from the input tokens rather than error nodes (1: every path from the input "
        "to the output goes through features); the completeness "
        "score the influence-weighted share of the nodes' inputs that is not error (1: the "
        "dictionary explains everything). The rule is the one the dictionary's export runs: "
        "its trained JumpReLU thresholds (the threshold rule, circuit-tracer's), else top-k. Open "
        "the browser from disk; it needs no server.",
        "",
        *_table(
            [
                "dictionary",
                "rule",
                "graph browser",
                "graphs / prompts",
                "replacement score (mean / min)",
                "completeness score (mean / min)",
            ],
            rows,
        ),
        "",
        *(["Prompts refused:", "", *refused, ""] if refused else []),
        *(line for shot in shots for line in (shot, "")),
    ]


def _global_weights(summary: dict) -> list[str]:
    """The global weights stage: each graphed dictionary's datasets and its strongest
    pairs, each feature a link to its page when the feature browsers are built."""
    g = summary.get("global_weights")
    if not g:
        return []
    pages = g.get("feature_pages") or {}
    lines = [
        "## Global weights",
        "",
        "Which features drive which in general, not on one prompt (docs/graphs.md). Virtual "
        "weights: from the dictionary's weights alone, through the residual stream (attention "
        "and normalisations left out), the strongest inputs and outputs of every feature. "
        "Expected attributions: each pair's direct effects summed over the graphs of the "
        "graphs stage, in Spark; TWERA weights them by the target's activation. Both are "
        "parquet partitioned by target layer; every feature page lists its strongest inputs "
        "and outputs of each.",
        "",
    ]
    for name, f in g["dictionaries"].items():
        where = f"{g['dir']}/{name}"
        v, e = f["virtual_weights"], f["expected_attributions"]
        lines += [
            f"- {_DICTIONARIES.get(name, name)}: [{where}/virtual_weights]({where}/virtual_weights)"
            f" ({v['pairs']:,} pairs, top {v['top_k']} per feature), "
            f"[{where}/expected_attributions]({where}/expected_attributions) "
            f"({e['pairs']:,} pairs over {e['graphs']} graphs)",
        ]
    lines += [""]

    def feature(layer: int, latent: int, pattern: str) -> str:
        text = f"L{layer} #{latent}"
        if not pattern:
            return text
        href = pattern.removeprefix("../../").replace("{layer}", str(layer))
        return f"[{text}]({href.replace('{latent}', str(latent))})"

    for name, f in g["dictionaries"].items():
        pattern = pages.get(name, "")
        strongest = f.get("strongest", {})
        rows = [[feature(r["source_layer"], r["source_latent"], pattern),
                 feature(r["target_layer"], r["target_latent"], pattern),
                 f"{r['sum']:.4g}", f"{r['twera']:.4g}", f"{r['mean']:.4g}", r["count"]]
                for r in strongest.get("expected_attributions", [])]  # fmt: skip
        if rows:
            lines += [f"Strongest expected attributions ({_DICTIONARIES.get(name, name)}), by "
                      "their total over the graphs:", ""]  # fmt: skip
            lines += [*_table(["source", "target", "total", "TWERA", "mean", "prompts"], rows), ""]
        rows = [[feature(r["source_layer"], r["source_latent"], pattern),
                 feature(r["target_layer"], r["target_latent"], pattern), f"{r['weight']:.4g}"]
                for r in strongest.get("virtual_weights", [])]  # fmt: skip
        if rows:
            lines += [f"Strongest virtual weights ({_DICTIONARIES.get(name, name)}):", ""]
            lines += [*_table(["source", "target", "virtual weight"], rows), ""]
    return lines


def _clip(text: str | None, length: int = 60) -> str:
    text = text or ""
    return text if len(text) <= length else text[: length - 1] + "…"


def _mlp_latency(summary: dict) -> list[str]:
    """Each MLP LUT against its dense block, and at Llama-3-8B's shapes when measured."""
    ev = summary["evaluation"]
    if not ev.get("mlp_latency"):
        return []
    rows = []
    shapes = [(block, rows_) for block, rows_ in ev["mlp_latency"].items()]
    if ev.get("mlp_latency_llama3_8b"):
        big = ev["mlp_latency_llama3_8b"]
        shapes.append((f"Llama-3-8B shapes ({big[0]['d_model']} → {big[0]['d_ff']}, "
                       f"{big[0]['num_basis']:,} latents, k={big[0]['k']}; random)", big))  # fmt: skip
    for name, timings in shapes:
        for r in timings:
            rows.append([
                name if name.startswith("Llama") else f"`{name}`", r["tokens"],
                f"{r['lut_s'] * 1e3:.3f}", f"{r['dense_s'] * 1e3:.3f}", f"{r['speedup']:.2f}×",
                f"{r['lut_flops']:,}", f"{r['dense_flops']:,}", f"{r['flop_ratio']:.2f}×",
            ])  # fmt: skip
    return [
        "## MLP LUT latency",
        "",
        "The patched block (`LUTMLP`: encode, top-k, k rows gathered) against the dense block "
        "(gate, up, activation, down) on the same inputs, float32 on this machine's CPU; FLOPs "
        "per token (docs/lut.md); above 1× the LUT is faster.",
        "",
        *_table(
            [
                "block",
                "tokens",
                "LUT ms",
                "dense ms",
                "dense / LUT",
                "LUT FLOPs",
                "dense FLOPs",
                "dense / LUT FLOPs",
            ],
            rows,
        ),
        "",
    ]


def _lm_loss(summary: dict) -> list[str]:
    """A causal LM's loss per hook point (the figures SAE papers compare) and with the LUT
    layers patched in; nothing for an encoder or an older summary."""
    ev = summary["evaluation"]
    lm = ev.get("lm_loss")
    if not lm:
        return []
    lines = [
        "## Language-model loss",
        "",
        f"Next-token cross-entropy (nats per token) over {lm['tokens']:,} predicted tokens of "
        f"the held-out passages; clean: **{lm['ce_clean']:.4f}**. Per hook point, the "
        "activation is replaced at every real token by the SAE's reconstruction (spliced), "
        "by zeros, or by its mean (a BOS token keeps its own: the SAEs never saw it); CE loss recovered = (CE zero − CE spliced) / "
        "(CE zero − CE clean), 1 = no loss, 0 = as bad as zero ablation; KL of the "
        "next-token distributions to the clean ones.",
        "",
    ]
    rows = []
    for hook, h in lm["hooks"].items():
        s = ev["sae"].get(hook, {})
        rows.append([
            f"`{hook}`", _num(s.get("fvu"), ".4f"), _num(s.get("l0"), ".1f"),
            _num(s.get("dead_fraction"), ".1%"), f"{h['ce_spliced']:.4f}",
            f"{h['ce_zero_ablated']:.4f}", f"{h['ce_mean_ablated']:.4f}",
            f"**{h['ce_loss_recovered']:.3f}**", f"{h['ce_loss_recovered_mean']:.3f}",
            f"{h['kl_spliced']:.3g}", f"{h['kl_zero_ablated']:.3g}",
        ])  # fmt: skip
    if rows:
        lines += _table(
            ["hook point", "FVU", "L0", "never fired", "CE spliced", "CE zero-abl.",
             "CE mean-abl.", "CE loss recovered", "recovered vs mean", "KL spliced", "KL zero-abl."],
            rows,
        )  # fmt: skip
    if lm.get("lut"):
        lines += [
            "",
            "With every LUT layer patched in at once (each at every position, as in use; "
            f"k = {ev['k_active']}, m = input dims added exactly):",
            "",
        ]
        rows = [
            [m, f"{v['ce']:.4f}", f"{v['ce_increase']:+.4f}", f"{v['kl']:.3g}"]
            for m, v in lm["lut"].items()
        ]
        lines += _table(["m", "CE", "CE − clean", "KL"], rows)
    return [*lines, ""]


def _num(value, spec: str) -> str:
    """A figure, blank when absent and "—" when undefined (NaN)."""
    if value is None:
        return ""
    return "—" if value != value else format(value, spec)


def _classifier(summary: dict) -> list[str]:
    """An image classifier's loss and accuracy with each SAE spliced in: the vision
    analogue of CE loss recovered."""
    cl = summary["evaluation"].get("classifier")
    if not cl:
        return []
    rows = []
    for name, h in cl["saes"].items():
        rows.append([
            f"`{name}`", h["tokens"], f"{h['ce_spliced']:.4f}", f"{h['accuracy_spliced']:.1%}",
            f"{h['ce_zero_ablated']:.4f}", f"{h['accuracy_zero_ablated']:.1%}",
            f"{h['ce_mean_ablated']:.4f}", f"{h['accuracy_mean_ablated']:.1%}",
            f"**{_num(h['loss_recovered'], '.3f')}**", _num(h["loss_recovered_mean"], ".3f"),
            f"{h['kl_spliced']:.3g}",
        ])  # fmt: skip
    header = ["SAE", "tokens", "CE spliced", "acc. spliced", "CE zero-abl.", "acc. zero-abl.",
              "CE mean-abl.", "acc. mean-abl.", "loss recovered", "recovered vs mean",
              "KL spliced"]  # fmt: skip
    return [
        "## Classifier with the SAEs spliced in",
        "",
        f"Cross-entropy (nats per image) and accuracy of the classifier on {cl['images']:,} "
        f"held-out images; clean: CE **{cl['ce_clean']:.4f}**, accuracy "
        f"**{cl['accuracy_clean']:.1%}**. At its hook point each SAE's reconstruction replaces "
        "the tokens it was trained on (`image`: every patch, `cls`: the CLS token), against "
        "the same tokens zero- or mean-ablated; loss recovered = (CE zero − CE spliced) / "
        "(CE zero − CE clean); KL of the class distributions to the clean ones. Where "
        "ablating the tokens leaves the classifier unchanged (patches after the last block "
        "that reads them: the classifier reads the CLS token), nothing is left to recover.",
        "",
        *_table(header, rows),
        "",
    ]


def _probing(summary: dict) -> list[str]:
    """SAEBench's sparse probing of each image SAE on the factors, beside the raw
    activations."""
    pr = summary["evaluation"].get("probing")
    if not pr or not pr["saes"]:
        return []
    keys = [k for k in next(iter(pr["saes"].values()))["sae"] if k != "tasks"]
    heads = [k.replace("top_", "top-") for k in keys]
    rows = []
    for name, r in pr["saes"].items():
        rows.append([f"`{name}`", r["tokens"]]
                    + [f"**{r['sae'][k]:.3f}**" for k in keys]
                    + [f"{r['activations'][k]:.3f}" for k in keys])  # fmt: skip
    header = (["SAE", "tokens"] + [f"SAE {h}" for h in heads]
              + [f"activations {h}" for h in heads])  # fmt: skip
    skipped = (f" Left out (too few images of the value in a split): "
               f"{', '.join(pr['skipped'])}." if pr["skipped"] else "")  # fmt: skip
    return [
        "## Sparse probing of the image factors",
        "",
        f"SAEBench's sparse probing on the held-out images' known factors: {len(pr['tasks'])} "
        'tasks, one per factor value ("is the colour red", one against the rest, '
        "balanced), each image the mean of the tokens an SAE reads and of its latents; "
        f"probes trained on {pr['train_images']} images and tested on the other "
        f"{pr['images'] - pr['train_images']}. Test accuracy, mean over the tasks, of an L2 "
        "logistic regression on the k latents whose class means differ most (top-k) and on "
        "all of them (full), beside the same probes on the raw activations." + skipped,
        "",
        *_table(header, rows),
        "",
    ]


def _lut_errors(summary: dict) -> list[str]:
    ev = summary["evaluation"]
    if not ev.get("lut"):  # no linear layers' LUTs: an image run, or MLP blocks only
        return []
    lines = [
        "## LUT layers",
        "",
        f"Relative L2 error and cosine of each LUT layer against the exact layer on held-out "
        f"inputs, as `relative L2 / cosine` per k; **bold**: the trained k = {ev['k_active']}; "
        "m = input dims whose contribution is added exactly.",
        "",
    ]
    ks = sorted({r["k"] for r in ev["lut"]})
    cells = {(r["layer"], r["m"], r["k"]): r for r in ev["lut"]}
    rows = []
    for layer, m in dict.fromkeys((r["layer"], r["m"]) for r in ev["lut"]):
        row = [f"`{layer}`", m]
        for k in ks:
            r = cells.get((layer, m, k))
            text = f"{r['rel_l2']:.3f} / {r['cosine']:.3f}" if r else ""
            row.append(f"**{text}**" if k == ev["k_active"] and r else text)
        rows.append(row)
    header = ["layer", "m"] + [f"**k={k}**" if k == ev["k_active"] else f"k={k}" for k in ks]
    return (
        lines
        + _table(header, rows)
        + ["", f"![LUT error against k]({summary['evaluation_dir']}/evaluation.png)", ""]
    )


def _lut_latency(summary: dict) -> list[str]:
    if not summary["evaluation"].get("latency"):
        return []
    rows = []
    for name, t in summary["evaluation"]["latency"].items():
        # per hook point since the layers sharing an encode are timed together; older
        # summaries hold one entry per layer
        layers = t.get("layers", [name])
        rows.append([
            f"`{name}`" if "layers" in t else "", ", ".join(f"`{n}`" for n in layers),
            t.get("encodes", 1), t["tokens"], f"{t['lut_ms']:.2f}", f"{t['dense_ms']:.2f}",
            f"{t['lut_over_dense']:.2f}×",
        ])  # fmt: skip
    header = ["hook point", "layers", "encodes", "tokens", "LUT ms", "dense ms", "LUT / dense"]
    return [
        "## LUT latency",
        "",
        *_table(header, rows),
        "",
        "Median of 7 runs on this machine, float32; below 1× the LUT is faster. A hook "
        "point's LUT layers run as a patched model runs them: those sharing an SAE encode "
        "each input once (`encodes`), then each gathers k rows of its table. Per token the "
        "encode costs num_basis × input_dim multiply-adds, the dense layers input_dim × "
        "their summed output_dim, so the LUT can only win where num_basis is below the "
        "summed output_dim of the layers sharing the encode (see docs/lut.md).",
        "",
    ]


def _embeddings(summary: dict) -> list[str]:
    cosines = summary["evaluation"].get("embedding_cosine")
    if cosines is None:  # a causal LM: its loss is the downstream figure
        return []
    return [
        "## Sentence embeddings",
        "",
        "Mean cosine between the model's mean-pooled embeddings with every LUT layer patched in "
        "and the original model's, on the held-out passages:",
        "",
        *_table(["m", "cosine"], [[m, f"{v:.4f}"] for m, v in cosines.items()]),
        "",
    ]


def _features(summary: dict) -> list[str]:
    """Each SAE's, transcoder's and crosscoder's feature browser: a link to the page (it
    opens from disk) and its picture."""
    if not summary.get("features"):
        return []
    lines = [
        "## Feature browsers",
        "",
        "Every latent's frequency, activation histogram, top-activating contexts and random "
        "examples per quantile band, computed in Spark over all extracted tokens "
        "(docs/features.md). Open the page in a browser; it needs no server.",
        "",
    ]
    for hook, f in summary["features"].items():
        over = ""
        if f.get("kind") == "crosscoder":  # one code over its hook points' rows, concatenated
            over = " (crosscoder over " + ", ".join(f"`{h}`" for h in f.get("hooks", ())) + ")"
        if f.get("kind") == "clt":  # one layer's latents of a cross-layer transcoder
            over = f" (CLT `{f['clt']}`'s layer {f['layer']}, on `{f['hooks'][0]}`)"
        lines += [
            f"- `{hook}`{over}: [{f['dir']}/features/index.html]({f['dir']}/features/index.html)"
            f" — {f['latents']:,} latents over {f['tokens']:,} tokens, {f['dead']} dead, "
            f"{f['dense']} dense",
        ]
    lines += [""]
    for hook, f in summary["features"].items():
        if f.get("screenshot"):
            lines += [f"![feature browser {hook}]({f['dir']}/feature-browser.png)", ""]
        lines += _ground_truth(hook, f.get("ground_truth"))
    return lines


def _ground_truth(hook: str, rows: list | None) -> list[str]:
    """Each generative factor value's best detector latent, patch by patch (AUROC)."""
    if not rows:
        return []
    table = [
        [r["factor"], r["value"], r["latent"], f"**{r['auroc']:.3f}**", f"{r['second_auroc']:.3f}",
         f"{r['fires_inside']:.1%}", f"{r['fires_outside']:.1%}"]
        for r in rows
    ]  # fmt: skip
    return [
        f"Ground truth of `{hook}`: for each generative factor value of the synthetic images, "
        "the single latent that best tells the patches inside a shape of that value from all "
        "other patches (AUROC), the runner-up's AUROC, and how often it fires inside and outside.",
        "",
        *_table(
            ["factor", "value", "latent", "AUROC", "runner-up", "fires inside", "fires outside"],
            table,
        ),
        "",
    ]


def _configuration(summary: dict) -> list[str]:
    return ["## Configuration", "", "```json", json.dumps(summary["config"], indent=2), "```", ""]
