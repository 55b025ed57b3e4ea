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
    sections = (_overview, _stages, _extraction, _saes, _lm_loss, _lut_errors, _lut_latency,
                _embeddings, _features, _configuration)  # fmt: skip
    return "\n".join(line for section in sections for line in section(summary))


def _overview(summary: dict) -> list[str]:
    c, ev = summary["config"], summary["evaluation"]
    return [
        "# Pipeline report",
        "",
        f"Model `{summary['source_model']}`; {c['texts']} training passages, "
        f"{ev['held_out_texts']} held-out passages never seen by any stage; "
        f"SAEs trained on {c['nproc']} process(es) ({c['parallel']} parallel). "
        f"Created {summary['created_at']}, {summary['seconds']:.0f} s in all.",
        "",
        *_toy_lm(summary),
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
        "held-out passages' tokens with the trained encoding.",
        "",
    ]
    rows = []
    for hook, t in summary["training"].items():
        h = ev["sae"][hook]
        rows.append([
            f"`{hook}`", f"{h['num_latents']} / k={h['k']}", f"{t['fvu']:.4f}", f"{h['fvu']:.4f}",
            f"{t['l0']:.1f}", f"{h['l0']:.1f}", f"{t['dead_fraction']:.1%}",
            f"{h['dead_fraction']:.1%}", f"{h['dense_fraction']:.1%}",
            f"{t.get('tokens_per_s', 0):,.0f}",
        ])  # fmt: skip
    lines += _table(
        ["hook point", "latents / k", "FVU (train)", "FVU (held-out)", "L0 (train)", "L0 (held-out)",
         "dead (train)", "never fired (held-out)", "dense >10% (held-out)", "tokens/s"],
        rows,
    )  # fmt: skip
    lines += [""]
    for hook in summary["training"]:
        lines += [f"![training {hook}]({summary['sae_runs'][hook]}/training.png)", ""]
    return [*lines, f"![latent frequency]({summary['evaluation_dir']}/latent_frequency.png)", ""]


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
    return "" if value is None else format(value, spec)


def _lut_errors(summary: dict) -> list[str]:
    ev = summary["evaluation"]
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
    """Each SAE's feature browser: a link to the page (it opens from disk) and its picture."""
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
        lines += [
            f"- `{hook}`: [{f['dir']}/features/index.html]({f['dir']}/features/index.html) — "
            f"{f['latents']:,} latents over {f['tokens']:,} tokens, {f['dead']} dead, "
            f"{f['dense']} dense",
        ]
    lines += [""]
    for hook, f in summary["features"].items():
        if f.get("screenshot"):
            lines += [f"![feature browser {hook}]({f['dir']}/feature-browser.png)", ""]
    return lines


def _configuration(summary: dict) -> list[str]:
    return ["## Configuration", "", "```json", json.dumps(summary["config"], indent=2), "```", ""]
