"""The research pipeline's graphs stage (``[pipeline.graphs]``): attribution graphs of
prompts through the cross-layer transcoder the pipeline trained and/or the per-layer
transcoders trained beside it, each dictionary's graphs a ``job.run_graphs`` output
(the dataset and the browser) in the stage's directory, and the figures the report
shows: the counts, the refused prompts and the scores' mean and min.

    [pipeline.graphs]
    clt = "all-mlps"                    # a [pipeline.clts] name (default: the only one)
    dictionaries = ["clt", "per_layer"] # the CLT, its per-layer transcoders, or both
    n_prompts = 16                      # held-out passages as prompts ...
    tokens = 32                         # ... each cut to this many tokens
    # prompts = "prompts.txt"           # or a text file, one prompt per line, as it is
    # node_threshold = 0.8              # pruning and logits: job.GraphsConfig's defaults
    # max_feature_nodes = 0             # partial attribution (0: every active feature)
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..format.errors import InvalidArgumentError

DICTIONARIES = ("clt", "per_layer")
"""What a graphs dataset can be made through: the CLT, or its per-layer transcoders."""
PRUNING = {"max_logits": int, "logit_probability": float, "node_threshold": float,
           "edge_threshold": float, "max_feature_nodes": int, "update_interval": int}  # fmt: skip
"""``job.GraphsConfig`` fields the table may set: pruning, logits and partial attribution
(unset: their defaults, circuit-tracer's)."""


@dataclass(frozen=True)
class GraphsStage:
    """The ``[pipeline.graphs]`` table, checked against ``[pipeline.clts]``."""

    clt: str
    """The ``[pipeline.clts]`` name whose dictionaries the graphs go through."""
    dictionaries: tuple[str, ...] = ("clt",)
    """"clt" and/or "per_layer" (the transcoders trained beside the CLT): a dataset each."""
    prompts: str = ""
    """A text file, one prompt per line, taken as it is; empty: held-out passages."""
    n_prompts: int = 16
    """Without ``prompts``: at most this many of the evaluation's held-out passages."""
    tokens: int = 32
    """Without ``prompts``: each passage cut to its first this many tokens (0: whole)."""
    pruning: tuple[tuple[str, int | float], ...] = ()
    """``PRUNING`` fields set by the table, as (name, value) pairs."""

    @classmethod
    def from_table(cls, table: Mapping, clts: Mapping[str, Mapping]) -> GraphsStage:
        """The stage of a ``[pipeline.graphs]`` table; ``InvalidArgumentError`` naming what
        to change."""
        fields = {"clt", "dictionaries", "prompts", "n_prompts", "tokens"}
        unknown = sorted(set(table) - fields - set(PRUNING))
        if unknown:
            raise InvalidArgumentError(
                f"graphs: unknown setting(s) {unknown}; known: {sorted(fields | set(PRUNING))}"
            )
        name = table.get("clt") or (next(iter(clts)) if len(clts) == 1 else "")
        if name not in clts:
            raise InvalidArgumentError(
                f"graphs: clt must name one of [pipeline.clts] {sorted(clts)}, got {name!r}"
            )
        dictionaries = tuple(table.get("dictionaries", ("clt",)))
        if not dictionaries or set(dictionaries) - set(DICTIONARIES):
            raise InvalidArgumentError(
                f"graphs: dictionaries must be some of {list(DICTIONARIES)}, got {dictionaries}"
            )
        if "per_layer" in dictionaries and not clts[name].get("per_layer", True):
            raise InvalidArgumentError(
                f"graphs: per_layer graphs need clt {name!r}'s per_layer = true"
            )
        stage = cls(name, dictionaries, str(table.get("prompts", "")),
                    int(table.get("n_prompts", 16)), int(table.get("tokens", 32)),
                    tuple((k, kind(table[k])) for k, kind in PRUNING.items() if k in table))  # fmt: skip
        if stage.n_prompts < 1 or stage.tokens < 0:
            raise InvalidArgumentError("graphs: n_prompts must be >= 1 and tokens >= 0")
        return stage

    def prompt_texts(self, tokenizer, held_out: Sequence[str]) -> list[str]:
        """The prompts: the file's lines, else the first ``n_prompts`` held-out passages
        cut to ``tokens`` tokens."""
        if self.prompts:
            return Path(self.prompts).read_text().splitlines()
        return cut_prompts(tokenizer, list(held_out)[: self.n_prompts], self.tokens)

    def dictionary_files(self, clt_file, clt_hooks: Sequence[str],
                         transcoders: Mapping[str, str | os.PathLike]) -> dict[str, tuple[str, ...]]:  # fmt: skip
        """Each dictionary's files: the CLT's, or the transcoders (by MLP block) of the blocks
        the CLT's input hook points name (``model.layers.N.mlp:input``), in its order."""
        blocks = [h.rpartition(":")[0] for h in clt_hooks[: len(clt_hooks) // 2]]
        files = {"clt": (str(clt_file),)}
        if "per_layer" in self.dictionaries:
            missing = [b for b in blocks if b not in transcoders]
            if missing:
                raise InvalidArgumentError(f"graphs: no per-layer transcoder of {missing}")
            files["per_layer"] = tuple(str(transcoders[b]) for b in blocks)
        return {name: files[name] for name in self.dictionaries}

    def key_parts(self, held_out: Sequence[str]) -> list:
        """What the stage's output depends on, besides the model and the dictionaries."""
        source = Path(self.prompts).read_text() if self.prompts else list(held_out)
        return [dataclasses.asdict(self), source]


def cut_prompts(tokenizer, texts: Sequence[str], tokens: int) -> list[str]:
    """Each text cut after its first ``tokens`` tokens as the model reads it (a BOS the
    tokenizer adds counts), by the tokenizer's character offsets; 0 or a shorter text:
    whole."""
    out = []
    for text in texts:
        if not tokens:
            out.append(text)
            continue
        # truncated: the first ``tokens`` tokens' offsets (no warning on long passages)
        offsets = tokenizer(text, return_offsets_mapping=True, truncation=True,
                            max_length=tokens)["offset_mapping"]  # fmt: skip
        out.append(text[: offsets[-1][1]] if len(offsets) == tokens else text)
    return out


def graph_figures(spark, stage: GraphsStage, *, model_dir: str | os.PathLike,
                  files: Mapping[str, Sequence[str]], held_out: Sequence[str],
                  out_dir: Path, feature_pages: Mapping[str, str] | None = None) -> dict:  # fmt: skip
    """Writes ``out_dir/{dictionary}/`` (``job.run_graphs``' output, and a screenshot of
    its browser, ``graph-browser.png``, when Chromium is here) for each dictionary of
    ``files`` (``GraphsStage.dictionary_files``) and returns ``{dictionary: its summary}``,
    which names its ``rule``: "threshold" for a CLT whose thresholds were trained (what its
    export runs), else "topk" (``sae.architectures.clt.dictionary_rule``).
    ``feature_pages``: each dictionary's pattern of a feature's page in its browser
    (``GraphsConfig.feature_pages``; none: no link)."""
    from transformers import AutoTokenizer

    from ..sae.architectures.clt import dictionary_rule
    from .job import GraphsConfig, run_graphs
    from .page import screenshot_graph

    prompts = stage.prompt_texts(AutoTokenizer.from_pretrained(model_dir), held_out)
    frame = spark.createDataFrame([(p,) for p in prompts], "prompt string")
    cores = spark.sparkContext.defaultParallelism
    threads = max(1, (os.cpu_count() or 1) // cores)  # the tasks share the machine's cores
    figures = {}
    for name, paths in files.items():
        rule = dictionary_rule(paths)  # the rule its export runs: trained thresholds' or top-k
        config = GraphsConfig(model=str(model_dir), transcoders=tuple(paths),
                              output=str(out_dir / name), threads=threads, rule=rule,
                              feature_pages=(feature_pages or {}).get(name, ""),
                              **dict(stage.pruning))  # fmt: skip
        summary = run_graphs(spark, config, frame)
        shot = screenshot_graph(out_dir / name, out_dir / name / "graph-browser.png")
        figures[name] = {**{k: v for k, v in summary.items() if k != "config"}, "rule": rule,
                         "prompts": len(prompts), "screenshot": shot is not None}  # fmt: skip
    return figures


def global_weight_figures(spark, graphs_dir: str | os.PathLike, dictionaries: Sequence[str],
                          out_dir: Path, *, top_k: int, links_top: int = 5,
                          feature_pages: Mapping[str, str] | None = None, pairs: int = 8) -> dict:  # fmt: skip
    """The global weights of each dictionary the graphs stage at ``graphs_dir`` graphed
    (``graph_figures``' folders), into ``out_dir/{dictionary}/``: its virtual weights
    (``top_k`` per feature; the model and files its graph job ran), the expected
    attributions over its graphs (Spark), and ``links/layer{block}.js`` per layer, each
    feature's ``links_top`` strongest inputs and outputs of each kind for its feature page
    (``features.page.links_script``, ``feature_pages[dictionary]`` the pattern of the pages
    they link). Returns ``{dictionary: {"virtual_weights": ..., "expected_attributions":
    ..., "strongest": the ``pairs`` strongest of each, "links": {block: features}}}``."""
    import json

    from ..features.page import links_script
    from .global_weights import (
        expected_attributions,
        feature_links,
        strongest_pairs,
        virtual_weights,
    )
    from .job import SUMMARY

    figures = {}
    for name in dictionaries:
        job = json.loads(Path(graphs_dir, name, SUMMARY).read_text())["config"]
        files = job["transcoders"]
        out = out_dir / name
        virtual = virtual_weights(job["model"], files[0] if len(files) == 1 else list(files),
                                  str(out), top_k=top_k, rule=job["rule"])  # fmt: skip
        expected = expected_attributions(spark, str(Path(graphs_dir, name)), str(out))
        links = feature_links(str(out), links_top)
        for block, latents in links.items():
            (out / "links").mkdir(parents=True, exist_ok=True)
            script = links_script(latents, layer=block, pages=(feature_pages or {}).get(name, ""))
            (out / "links" / f"layer{block}.js").write_bytes(script)
        figures[name] = {"virtual_weights": {k: v for k, v in virtual.items() if k not in ("model", "dictionary")},
                         "expected_attributions": {k: v for k, v in expected.items() if k != "out"},
                         "strongest": strongest_pairs(str(out), pairs),
                         "links": {str(b): len(v) for b, v in sorted(links.items())}}  # fmt: skip
    return figures
