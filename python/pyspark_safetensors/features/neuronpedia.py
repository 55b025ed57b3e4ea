"""A feature job's output (``run_features``: ``latents.parquet``, ``contexts.parquet``,
``features.json``) as the field's feature viewers read it.

**Feature JSON** (``feature_json``), the file circuit-tracer's graph frontend and
Neuronpedia's graph viewer fetch for each feature node, ``{index}.json`` with ``index``
the node's ``feature`` (the Cantor pairing of layer and latent, ``graphs.export.cantor``).
Layout: circuit-tracer's ``frontend/feature_models.py`` (``Model``: ``transcoder_id``,
``index``, ``examples_quantiles`` of ``{quantile_name, examples}``, each example
``{tokens_acts_list, train_token_ind, is_repeated_datapoint, tokens}``, ``top_logits``,
``bottom_logits``, ``act_min``, ``act_max``, ``quantile_values``, ``histogram``,
``activation_frequency``), read by its ``assets/feature_examples/*.js`` and
``attribution_graph/render-act-histogram.js``; Neuronpedia publishes the part it requires
(``apps/webapp/app/api/graph/feature-details-schema.json``, vendored in
``tests/graphs/data/``) and fetches ``{feature_json_base_url}/{feature}.json``.

- ``examples_quantiles``: "Top activations" (the browser's top-N, largest first), then
  one group per quantile band of its random examples (``Quantile 25-50%``); an example is
  its context window, ``train_token_ind`` the example token, ``is_repeated_datapoint``
  when an earlier example of the feature showed the same model input;
- ``act_min`` 0, ``act_max`` the latent's largest activation; ``activation_frequency``
  its firing frequency;
- ``histogram``: counts of its non-zero activations in ``hist_bins`` equal bins from
  ``act_min`` to ``act_max`` (the viewer draws it on that linear scale), and
  ``quantile_values``: the activations at the 1st ... 100th percentile. Both come from the
  browser's log-spaced histogram, each bin's count spread evenly over its range (in
  value for ``histogram``, in log value for the percentiles): approximate within a bin
  (a factor ``(hist_max / hist_min) ** (1 / hist_bins)``, 1.41 by default); the 100th is
  the exact maximum;
- ``top_logits`` / ``bottom_logits``: the tokens whose logits the latent's decoder
  direction raises / lowers most on the direct path (``decoder_logits``), empty when no
  model is given.

**Neuronpedia's export** (``export_neuronpedia``), the layout of its public datasets
(``v1/{modelId}/{sourceId}/...``) that its webapp's importer (``apps/webapp/app/api/admin/
import/route.ts``, ``lib/db/import.ts``) loads, as its own tools write it
(``utils/neuronpedia-utils``: ``convert-saedashboard-to-neuronpedia-export.py`` from
SAEDashboard's ``NeuronpediaRunner`` output, ``export-data.py``, ``db_models/``):

- ``{model}/{source}/model.jsonl``, ``release.jsonl``, ``sourceset.jsonl``,
  ``source.jsonl``: one row each (Prisma's ``Model``, ``SourceRelease``, ``SourceSet``,
  ``Source``); ``source`` is ``{layer}-{source_set}``, Neuronpedia's naming;
- ``features/batch-{n}.jsonl.gz``: a row per latent (table ``Neuron``), ``batch_size``
  a file in index order: ``modelId``, ``layer`` (the source), ``index`` (a string),
  ``sourceSetName``, ``creatorId``, ``maxActApprox`` (its largest activation),
  ``frac_nonzero`` (its frequency), ``freq_hist_data_bar_values`` / ``_heights`` (the
  linear histogram above: bin centres, counts), ``pos_str`` / ``pos_values`` and
  ``neg_str`` / ``neg_values`` (top and bottom logits, SAEDashboard's names),
  ``logits_hist_data_bar_values`` / ``_heights`` (the histogram of its logit weights over
  the vocabulary);
- ``activations/batch-{n}.jsonl.gz``: a row per example of those latents (``Activation``):
  ``id``, ``tokens``, ``values`` (the window), ``maxValue``, ``maxValueTokenIndex``,
  ``minValue``, ``qualifyingTokenIndex`` (the example token), ``binMin`` / ``binMax`` /
  ``binContains`` as SAEDashboard's converter sets them: -1, the latent's maximum, -1 for a
  top example; the band's activation range and share of the latent's activations for a
  random one;
- ``explanations/batch-{n}.jsonl.gz`` with ``labels``: ``id``, ``modelId``, ``layer``,
  ``index``, ``description``, ``authorId``.

Every row of a file has the same keys (the importer takes the first row's as the columns).
Ids are deterministic (a hash of the row's key), so a re-export replaces rows, and the
creator is Neuronpedia's default user unless ``creator_id`` says otherwise (the
importing instance must hold that user).

    export_neuronpedia(NeuronpediaConfig(features="out/features/layer1", out="out/np",
                                         model_id="toy-llama", source_set="clt-64"))
"""

from __future__ import annotations

import gzip
import hashlib
import io
import itertools
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .config import FeaturesError

DEFAULT_CREATOR_ID = "clkht01d40000jv08hvalcvly"
"""Neuronpedia's default user (its ``prisma/seed.ts`` creates it; ``DEFAULT_CREATOR_USER_ID``):
the creator of its own exports."""
BATCH_SIZE = 1024
"""Rows per ``batch-{n}.jsonl.gz`` (Neuronpedia's ``FEATURES_EXPLANATIONS_BATCH_SIZE``)."""
TOP_QUANTILE = "Top activations"
FEATURE_JSON_FIELDS = ("transcoder_id", "index", "examples_quantiles", "top_logits",
                       "bottom_logits", "act_min", "act_max", "quantile_values", "histogram",
                       "activation_frequency")  # fmt: skip
"""A feature JSON's keys, in the order of circuit-tracer's ``feature_models.Model``."""
_SOURCE_SET = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")


@dataclass(frozen=True)
class Browser:
    """A feature job's output, read back: its tables and ``features.json``."""

    latents: pa.Table
    """``latents.parquet``, sorted by latent."""
    contexts: pa.Table
    """``contexts.parquet``."""
    doc: dict
    """``features.json``."""

    @property
    def config(self) -> dict:
        return self.doc["config"]

    @property
    def clt_layer(self) -> int:
        return int(self.config.get("clt_layer", -1))

    @property
    def edges(self) -> np.ndarray:
        from .state import histogram_edges

        c = self.config
        return histogram_edges(int(c["hist_bins"]), float(c["hist_min"]), float(c["hist_max"]))


def read_browser(path: str, storage_options: Mapping[str, str] | None = None) -> Browser:
    """The tables and ``features.json`` of a finished feature job at ``path``."""
    from ..dataset import DatasetLocation
    from .job import CONTEXTS_FILE, FEATURES_DOC, LATENTS_FILE

    src = DatasetLocation.of(path, storage_options=dict(storage_options or {}))
    if not src.has(FEATURES_DOC):
        raise FeaturesError(
            f"{src.display(FEATURES_DOC)}: not a finished feature job's output "
            "(run `pyspark-safetensors features`)"
        )
    doc = json.loads(src.read_bytes(FEATURES_DOC))
    if doc.get("summary", {}).get("modality", "text") != "text":
        raise FeaturesError(f"{path}: an image browser; these exports show text contexts")
    latents = pq.read_table(io.BytesIO(src.read_bytes(LATENTS_FILE))).sort_by("latent")
    contexts = pq.read_table(io.BytesIO(src.read_bytes(CONTEXTS_FILE)))
    return Browser(latents, contexts, doc)


# ---- statistics from the browser's histogram -------------------------------------------


def _bins(edges: np.ndarray, vmax: float) -> tuple[np.ndarray, np.ndarray]:
    """Each histogram bin's value range: the end bins hold what fell outside (the first
    from 0), and nothing lies above the latent's maximum."""
    lo, hi = edges[:-1].astype(np.float64), edges[1:].astype(np.float64)
    lo[0], hi[-1] = 0.0, max(hi[-1], vmax)
    hi = np.minimum(hi, vmax)
    return np.minimum(lo, hi), hi


def linear_histogram(counts: np.ndarray, edges: np.ndarray, vmax: float,
                     n_bins: int) -> np.ndarray:  # fmt: skip
    """``counts`` (log-spaced bins of ``edges``) in ``n_bins`` equal bins over
    ``[0, vmax]``, each bin's count spread evenly over its range."""
    counts = np.asarray(counts, np.float64)
    if vmax <= 0 or counts.sum() == 0:
        return np.zeros(n_bins)
    lo, hi = _bins(edges, vmax)
    grid = np.linspace(0.0, vmax, n_bins + 1)
    overlap = np.clip(np.minimum(hi[:, None], grid[None, 1:]) - np.maximum(lo[:, None], grid[None, :-1]), 0, None)  # fmt: skip
    width = hi - lo
    share = np.where(width[:, None] > 0, overlap / np.where(width > 0, width, 1)[:, None], 0.0)
    point = width <= 0  # a bin squeezed to one value: its count in that value's bin
    share[point, np.minimum(np.searchsorted(grid, hi[point], side="right") - 1, n_bins - 1)] = 1.0
    return counts @ share


def quantile_values(counts: np.ndarray, edges: np.ndarray, vmax: float,
                    levels: Iterable[float]) -> list[float]:  # fmt: skip
    """The activation at each quantile ``level`` of the non-zero activations, from the
    histogram (interpolated in log value within a bin; the last level 1.0 is ``vmax``)."""
    counts = np.asarray(counts, np.float64)
    total = counts.sum()
    if total == 0:
        return [0.0 for _ in levels]
    lo, hi = _bins(edges, vmax)
    lo = np.where(lo > 0, lo, np.minimum(edges[0], hi))  # the first bin, in log value
    cum = np.cumsum(counts)
    out = []
    for q in levels:
        b = min(int(np.searchsorted(cum, q * total - 1e-9 * total, side="left")), len(counts) - 1)
        frac = (q * total - (cum[b] - counts[b])) / counts[b] if counts[b] else 1.0
        frac = min(max(frac, 0.0), 1.0)
        out.append(float(lo[b] * (hi[b] / lo[b]) ** frac) if lo[b] > 0 else float(hi[b] * frac))
    return out


def band_ranges(counts: np.ndarray, edges: np.ndarray, vmax: float,
                bands: tuple[float, ...]) -> dict[str, tuple[float, float, float]]:  # fmt: skip
    """Per band label (``q0.25-0.50``, as ``merge.examples_table`` names them): the
    activation range of the band's histogram bins and their share of the activations
    (a bin is in the band its lower cumulative fraction falls in, the job's rule)."""
    counts = np.asarray(counts, np.float64)
    total = max(counts.sum(), 1.0)
    below = (np.cumsum(counts) - counts) / total
    band = np.searchsorted(np.asarray(bands), below, side="right") - 1
    lo, hi = _bins(edges, vmax)
    out = {}
    for j, (a, b) in enumerate(itertools.pairwise(bands)):
        inside = (band == j) & (counts > 0)
        if inside.any():
            out[f"q{a:.2f}-{b:.2f}"] = (float(lo[inside].min()), float(hi[inside].max()),
                                        float(counts[inside].sum() / total))  # fmt: skip
    return out


def _band_title(kind: str) -> str:
    lo, hi = (float(x) for x in kind[1:].split("-"))
    return f"Quantile {lo * 100:.0f}-{hi * 100:.0f}%"


# ---- logits ------------------------------------------------------------------------------


def decoder_directions(sae: str, clt_layer: int = -1):
    """``[n_latents, d]``: each latent's total write into the residual stream (a CLT
    layer's decoders summed over the blocks it writes; a tied CLT's one decoder as often)."""
    from ..sae.architectures.clt import decoder_name
    from ..sae.ecosystem import read_sae

    tensors, info = read_sae(sae)
    name = decoder_name(clt_layer) if clt_layer >= 0 else "decoder_weight"
    if name not in tensors:
        raise FeaturesError(f"{sae}: no {name} (a CLT needs its layer, another SAE none)")
    w = tensors[name].float()
    if w.dim() == 3:  # [n, targets, d]
        meta = info.get("metadata") or {}
        tied = str(meta.get("tied_decoders", "false")).lower() == "true"
        times = int(meta.get("n_layers", 1)) - clt_layer if tied else 1
        w = w.sum(1) * times
    return w


def decoder_logits(directions, model_dir: str, *, k: int = 10, hist_bins: int = 0,
                   chunk: int = 256) -> dict:  # fmt: skip
    """Each latent's direct effect on the logits: its decoder direction through the
    model's final norm (its elementwise scale; not its bias, nor the division by the
    stream's size: SAEDashboard's ``W_dec @ W_U`` of a model with its norms folded) and
    unembedding. Returns
    ``top_ids``, ``top_values``, ``bottom_ids``, ``bottom_values`` ``[n, k]`` (largest
    and smallest first) and, with ``hist_bins``, ``hist_heights`` / ``hist_values``
    ``[n, hist_bins]`` (the histogram of each latent's logit weights over the vocabulary)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    unembed = model.get_output_embeddings().weight.float()
    base = model.get_submodule(model.base_model_prefix) if model.base_model_prefix else model
    norm = next((getattr(base, n) for n in ("norm", "final_layer_norm", "ln_f")
                 if isinstance(getattr(base, n, None), torch.nn.Module)), None)  # fmt: skip
    gain = torch.ones(unembed.shape[1])
    with torch.inference_mode():
        if norm is not None:  # its elementwise scale: norm(v) - norm(-v) = 2 w v at |v_i| = 1
            v = torch.ones(1, unembed.shape[1])
            v[:, 1::2] = -1  # mean 0, every entry of size 1: a LayerNorm's and an RMSNorm's alike
            gain = ((norm(v) - norm(-v)).float() / (2 * v))[0]
        parts: dict[str, list] = {n: [] for n in ("top_ids", "top_values", "bottom_ids",
                                                  "bottom_values", "hist_heights", "hist_values")}  # fmt: skip
        k = min(k, unembed.shape[0])
        for lo in range(0, len(directions), chunk):
            logits = (directions[lo : lo + chunk].float() * gain) @ unembed.t()
            top, bottom = logits.topk(k, dim=1), logits.topk(k, dim=1, largest=False)
            parts["top_ids"].append(top.indices.numpy())
            parts["top_values"].append(top.values.numpy())
            parts["bottom_ids"].append(bottom.indices.numpy())
            parts["bottom_values"].append(bottom.values.numpy())
            for row in logits.numpy() if hist_bins else ():
                heights, edges = np.histogram(row, bins=hist_bins)
                parts["hist_heights"].append(heights)
                parts["hist_values"].append((edges[:-1] + edges[1:]) / 2)
    return {n: np.concatenate(v) if n in ("top_ids", "top_values", "bottom_ids", "bottom_values")
            else np.asarray(v) for n, v in parts.items()}  # fmt: skip


def _tokenizer(model_dir: str):
    from .job import load_tokenizer

    return load_tokenizer(model_dir)


def model_dir_of(browser: Browser, model: str = "") -> str:
    """``model``, else the model directory the feature job's extraction recorded."""
    from ..dataset import DatasetLocation
    from .job import EXTRACTION_DOC

    if model:
        return model
    src = DatasetLocation.of(browser.doc["extraction"])
    doc = json.loads(src.read_bytes(EXTRACTION_DOC)) if src.has(EXTRACTION_DOC) else {}
    found = doc.get("model_dir") or ""
    if not Path(found, "config.json").is_file():
        raise FeaturesError(
            f"{browser.doc['extraction']}: its model directory {found!r} is gone; give the "
            "model (its tokenizer names the logits' tokens)"
        )
    return found


# ---- the feature JSON --------------------------------------------------------------------


def _examples(browser: Browser, latents: Iterable[int]) -> dict[int, list[dict]]:
    """Each latent's context rows: top examples first (by rank), then each band in order."""
    wanted = set(latents)
    rows = [r for r in browser.contexts.to_pylist() if r["latent"] in wanted]
    rows.sort(key=lambda r: (r["latent"], r["kind"] != "top", r["kind"], r["rank"]))
    out: dict[int, list[dict]] = {}
    for r in rows:
        out.setdefault(r["latent"], []).append(r)
    return out


def feature_json(browser: Browser, latent: int, *, index: int, transcoder_id: str,
                 top_logits: list[str] | None = None, bottom_logits: list[str] | None = None,
                 examples: list[dict] | None = None) -> dict:  # fmt: skip
    """One latent of ``browser`` as circuit-tracer's feature JSON (module docstring)."""
    row = browser.latents.slice(latent, 1).to_pylist()[0]
    assert row["latent"] == latent, "latents.parquet holds every latent in order"
    if examples is None:
        examples = _examples(browser, [latent]).get(latent, [])
    groups: dict[str, list[dict]] = {}
    seen = set()
    for r in examples:
        if not r["tokens"]:
            continue
        source = (r["sample_id"], r["window"])
        groups.setdefault(r["kind"], []).append({
            "tokens_acts_list": [float(a) for a in r["acts"]],
            "train_token_ind": int(r["center"]),
            "is_repeated_datapoint": source in seen,
            "tokens": list(r["tokens"]),
        })  # fmt: skip
        seen.add(source)
    quantiles = [{"quantile_name": TOP_QUANTILE if kind == "top" else _band_title(kind),
                  "examples": exs} for kind, exs in groups.items()]  # fmt: skip
    edges, vmax = browser.edges, float(row["max"])
    doc = {
        "transcoder_id": transcoder_id, "index": int(index), "examples_quantiles": quantiles,
        "top_logits": list(top_logits or []), "bottom_logits": list(bottom_logits or []),
        "act_min": 0.0, "act_max": vmax,
        "quantile_values": quantile_values(row["hist"], edges, vmax,
                                           [(i + 1) / 100 for i in range(100)]),
        "histogram": linear_histogram(row["hist"], edges, vmax, len(edges) - 1).tolist(),
        "activation_frequency": float(row["frequency"]),
    }  # fmt: skip
    return {k: doc[k] for k in FEATURE_JSON_FIELDS}


def feature_jsons(browser: Browser, latents: Iterable[int], *, index_of, transcoder_id: str,
                  model_dir: str = "", k: int = 10) -> dict[int, dict]:  # fmt: skip
    """``{latent: feature JSON}`` of ``latents``; ``index_of(latent)``: its ``index``;
    with ``model_dir`` the top and bottom ``k`` logits (``decoder_logits``)."""
    latents = sorted(set(latents))
    if not latents:
        return {}
    names: dict[int, tuple[list[str], list[str]]] = {}
    if model_dir:
        directions = decoder_directions(browser.doc["sae"], browser.clt_layer)[latents]
        logits = decoder_logits(directions, model_dir, k=k)
        tok = _tokenizer(model_dir)
        for i, latent in enumerate(latents):
            names[latent] = ([tok.decode([int(t)]) for t in logits["top_ids"][i]],
                             [tok.decode([int(t)]) for t in logits["bottom_ids"][i]])  # fmt: skip
    examples = _examples(browser, latents)
    return {latent: feature_json(browser, latent, index=index_of(latent),
                                 transcoder_id=transcoder_id, examples=examples.get(latent, []),
                                 top_logits=names.get(latent, ([], []))[0],
                                 bottom_logits=names.get(latent, ([], []))[1])
            for latent in latents}  # fmt: skip


# ---- Neuronpedia's export ----------------------------------------------------------------


@dataclass(frozen=True)
class NeuronpediaConfig:
    """A feature job's latents as Neuronpedia's export of one source."""

    features: str
    """A feature job's output (``pyspark-safetensors features``): a local path or a URI."""
    out: str
    """The export's root (replaced whole): ``{model_id}/{layer}-{source_set}/...``; a local
    path or a URI."""
    model_id: str = ""
    """Neuronpedia's model id (e.g. ``gemma-2-2b``); empty: the model directory's name."""
    source_set: str = "pyspark-safetensors"
    """The source set: the source is ``{layer}-{source_set}`` (letters, digits, ``-``, ``_``)."""
    layer: int = -1
    """The source's layer; -1: a CLT browser's layer, else the first number of its hook
    point (``model.layers.3.mlp:input`` -> 3)."""
    labels: str = ""
    """A table of labels (parquet or JSON lines: ``layer``, ``latent``, ``label``, e.g.
    delphi's explanations): written as ``explanations/`` for this layer; empty: none."""
    model: str = ""
    """The model directory (its tokenizer and unembedding give the logits); empty: the one
    the feature job's extraction recorded."""
    logits: bool = True
    """Compute each latent's top and bottom logits and their histogram (loads the model)."""
    top_logits: int = 10
    """Tokens in ``pos_str`` and ``neg_str`` each."""
    batch_size: int = BATCH_SIZE
    """Latents (their features and activations) per ``batch-{n}`` file."""
    creator_id: str = DEFAULT_CREATOR_ID
    """The rows' ``creatorId`` / ``authorId``: a user of the importing instance."""
    creator_name: str = "pyspark-safetensors"
    description: str = ""
    """The source set's and release's description; empty: the hook point and width."""

    def __post_init__(self):
        if not _SOURCE_SET.match(self.source_set):
            raise FeaturesError(
                f"source_set: letters, digits, '-' and '_', got {self.source_set!r}"
            )
        if self.model_id and not _SOURCE_SET.match(self.model_id):
            raise FeaturesError(f"model_id: letters, digits, '-' and '_', got {self.model_id!r}")
        if self.batch_size < 1 or self.top_logits < 1:
            raise FeaturesError("batch_size and top_logits must be >= 1")
        if self.layer < -1:
            raise FeaturesError(f"layer must be >= 0 (or -1: the browser's), got {self.layer}")


def layer_of(browser: Browser, layer: int = -1) -> int:
    """``layer``, else a CLT browser's layer, else the first number of its hook point."""
    if layer >= 0:
        return layer
    if browser.clt_layer >= 0:
        return browser.clt_layer
    found = re.search(r"\d+", browser.doc.get("summary", {}).get("hook", ""))
    if found is None:
        raise FeaturesError(
            f"{browser.doc.get('summary', {}).get('hook')!r}: no layer number; give layer"
        )
    return int(found.group())


def _id(*key) -> str:
    """A deterministic cuid-like id of a row's key."""
    return "c" + hashlib.sha1("\x1f".join(map(str, key)).encode()).hexdigest()[:24]


def _jsonl_gz(rows: list[dict]) -> bytes:
    text = "".join(json.dumps(r, separators=(",", ":"), allow_nan=False) + "\n" for r in rows)
    return gzip.compress(text.encode(), compresslevel=5, mtime=0)


def _round(values, digits: int = 4) -> list[float]:
    return [round(float(v), digits) for v in values]


def neuronpedia_rows(browser: Browser, config: NeuronpediaConfig, *, model_id: str,
                     source: str, logits: dict | None, token_text,
                     labels: Mapping[tuple[int, int], str], layer: int) -> dict[str, list[dict]]:  # fmt: skip
    """``{"features", "activations", "explanations"}``: every row of the export, in index
    order (module docstring)."""
    edges = browser.edges
    n_bins = len(edges) - 1
    bands = tuple(float(b) for b in browser.config["bands"])
    examples = _examples(browser, range(browser.latents.num_rows))
    creator = config.creator_id
    features, activations, explanations = [], [], []
    for row in browser.latents.to_pylist():
        latent, vmax = int(row["latent"]), float(row["max"])
        heights = linear_histogram(row["hist"], edges, vmax, n_bins)
        width = vmax / n_bins
        feature = {
            "modelId": model_id, "layer": source, "index": str(latent),
            "sourceSetName": config.source_set, "creatorId": creator, "maxActApprox": vmax,
            "frac_nonzero": float(row["frequency"]),
            "freq_hist_data_bar_heights": _round(heights, 3),
            "freq_hist_data_bar_values": _round((np.arange(n_bins) + 0.5) * width),
            "pos_str": [], "pos_values": [], "neg_str": [], "neg_values": [],
            "logits_hist_data_bar_heights": [], "logits_hist_data_bar_values": [],
        }  # fmt: skip
        if logits is not None:
            feature |= {
                "pos_str": [token_text(t) for t in logits["top_ids"][latent]],
                "pos_values": _round(logits["top_values"][latent]),
                "neg_str": [token_text(t) for t in logits["bottom_ids"][latent]],
                "neg_values": _round(logits["bottom_values"][latent]),
                "logits_hist_data_bar_heights": [float(h) for h in logits["hist_heights"][latent]],
                "logits_hist_data_bar_values": _round(logits["hist_values"][latent]),
            }  # fmt: skip
        features.append(feature)
        ranges = band_ranges(row["hist"], edges, vmax, bands)
        for r in examples.get(latent, []):
            if not r["tokens"]:
                continue
            values = [float(a) for a in r["acts"]]
            top = r["kind"] == "top"
            lo, hi, share = (-1.0, vmax, -1.0) if top else ranges.get(r["kind"], (0.0, 0.0, 0.0))
            activations.append({
                "id": _id(model_id, source, latent, r["kind"], r["rank"]),
                "tokens": list(r["tokens"]), "modelId": model_id, "layer": source,
                "index": str(latent), "maxValue": max(values),
                "maxValueTokenIndex": int(np.argmax(values)), "minValue": min(values),
                "values": values, "creatorId": creator, "binMin": lo, "binMax": hi,
                "binContains": share,
                "qualifyingTokenIndex": int(r["center"]) if r["center"] >= 0 else None,
            })  # fmt: skip
        if (layer, latent) in labels:
            explanations.append({
                "id": _id(model_id, source, latent, "explanation"), "modelId": model_id,
                "layer": source, "index": str(latent),
                "description": labels[(layer, latent)], "authorId": creator,
            })  # fmt: skip
    return {"features": features, "activations": activations, "explanations": explanations}


def read_labels(path: str) -> dict[tuple[int, int], str]:
    """``{(layer, latent): label}`` from a parquet table or JSON lines (``layer``,
    ``latent``, ``label``)."""
    if not path:
        return {}
    p = Path(path)
    if p.suffix in (".jsonl", ".json"):
        rows = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    else:
        rows = pq.read_table(p).to_pylist()
    missing = {"layer", "latent", "label"} - set(rows[0] if rows else {"layer", "latent", "label"})
    if missing:
        raise FeaturesError(f"{path}: a labels table needs columns {sorted(missing)}")
    return {(int(r["layer"]), int(r["latent"])): str(r["label"]) for r in rows}


def export_neuronpedia(config: NeuronpediaConfig, *,
                       storage_options: Mapping[str, str] | None = None) -> dict:  # fmt: skip
    """The export (module docstring), published whole; returns ``{"out", "model_id",
    "source", "features", "activations", "explanations", "files"}``."""
    from ..dataset import DatasetLocation
    from ..dataset.publish import staged_output

    options = dict(storage_options or {})
    browser = read_browser(config.features, options)
    layer = layer_of(browser, config.layer)
    model_dir = model_dir_of(browser, config.model) if (config.logits or config.model) else ""
    model_id = config.model_id or (Path(model_dir).name if model_dir else "")
    if not _SOURCE_SET.match(model_id):
        raise FeaturesError(f"model_id: give Neuronpedia's model id (got {model_id!r})")
    source = f"{layer}-{config.source_set}"
    logits, token_text = None, str
    if config.logits:
        directions = decoder_directions(browser.doc["sae"], browser.clt_layer)
        logits = decoder_logits(directions, model_dir, k=config.top_logits,
                                hist_bins=len(browser.edges) - 1)  # fmt: skip
        tok = _tokenizer(model_dir)
        token_text = lambda t: tok.decode([int(t)])  # noqa: E731
    labels = read_labels(config.labels)
    rows = neuronpedia_rows(browser, config, model_id=model_id, source=source, logits=logits,
                            token_text=token_text, labels=labels, layer=layer)  # fmt: skip
    n_latents = browser.latents.num_rows
    hook = browser.doc.get("summary", {}).get("hook", "")
    description = config.description or f"{hook} - {n_latents} latents"
    creator, name = config.creator_id, config.creator_name
    model_config = json.loads(Path(model_dir, "config.json").read_text()) if model_dir else {}
    meta = {
        "model.jsonl": {"id": model_id, "displayNameShort": model_id, "displayName": model_id,
                        "creatorId": creator, "visibility": "PUBLIC",
                        "layers": int(model_config.get("num_hidden_layers", 0)),
                        "neuronsPerLayer": int(model_config.get("intermediate_size", 0)),
                        "owner": name},
        "release.jsonl": {"name": config.source_set, "description": description,
                          "creatorName": name, "creatorId": creator, "visibility": "PUBLIC",
                          "urls": []},
        "sourceset.jsonl": {"modelId": model_id, "name": config.source_set,
                            "description": description, "creatorName": name,
                            "creatorId": creator, "visibility": "PUBLIC", "urls": [],
                            "releaseName": config.source_set},
        "source.jsonl": {"id": source, "modelId": model_id, "setName": config.source_set,
                         "creatorId": creator, "visibility": "PUBLIC", "hasDashboards": True,
                         "num_tokens_in_prompt": None, "num_prompts": None,
                         "dataset": str(browser.doc.get("extraction", "")),
                         "notes": f"{browser.doc.get('sae', '')} on {hook}"},
    }  # fmt: skip
    base = f"{model_id}/{source}"
    target = DatasetLocation.of(config.out, storage_options=options)
    files = []
    with staged_output(target, f"{base}/source.jsonl") as out:
        for part, key in (("features", "index"), ("activations", "index"),
                          ("explanations", "index")):  # fmt: skip
            by_latent: dict[int, list[dict]] = {}
            for r in rows[part]:
                by_latent.setdefault(int(r[key]) // config.batch_size, []).append(r)
            for batch in sorted(by_latent):
                files.append(f"{base}/{part}/batch-{batch}.jsonl.gz")
                out.staging.put_bytes(files[-1], _jsonl_gz(by_latent[batch]))
        for name_, row in meta.items():
            files.append(f"{base}/{name_}")
            out.staging.put_bytes(files[-1], (json.dumps(row) + "\n").encode())
    return {"out": config.out, "model_id": model_id, "source": source,
            **{part: len(rows[part]) for part in rows}, "files": files}  # fmt: skip
