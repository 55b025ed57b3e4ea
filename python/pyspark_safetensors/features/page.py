"""The static feature browser: ``index.html`` and ``data/*.js`` beside it, opened from
disk (no server, no network). The data are scripts assigning globals, since browsers
refuse ``fetch()`` of ``file://`` URLs: ``data/latents.js`` (every latent's statistics,
histogram and top tokens, for the list and the search) and ``data/contexts-NNNN.js``
(the examples of ``CHUNK`` latents each, loaded when a latent of theirs is opened).
``data/links.js``, when there (``links_script``: written by whatever computed the global
weights, the pipeline's ``global-weights`` stage, not by the feature job), adds each
latent's strongest inputs and outputs, each a link to that feature's page."""

from __future__ import annotations

import json
from importlib import resources

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .config import FeaturesConfig
from .state import histogram_edges

CHUNK = 256
TOP_TOKENS = 8


def _js(name: str, value) -> str:
    return f"window.{name} = {json.dumps(value, separators=(',', ':'))};\n"


def _round(x: float) -> float:
    return float(f"{x:.4g}")


def _rounded(x: np.ndarray) -> list[float]:
    """``_round`` of every value, vectorised: 4 significant digits, each the double
    nearest its decimal (so JSON writes it short)."""
    x = np.asarray(x, np.float64)
    out = np.zeros_like(x)
    nz = np.flatnonzero(x)
    v = x[nz]
    e = 3 - np.floor(np.log10(np.abs(v))).astype(np.int64)
    up = e >= 0  # divide by an exact power of ten: the result is the nearest double
    r = np.empty_like(v)
    r[up] = np.rint(v[up] * 10.0 ** e[up]) / 10.0 ** e[up]
    r[~up] = np.rint(v[~up] / 10.0 ** -e[~up]) * 10.0 ** -e[~up]
    out[nz] = r
    return out.tolist()


def browser_files(
    latents: pa.Table, contexts: pa.Table, *, title: str, tokens: int, config: FeaturesConfig
) -> dict[str, bytes]:
    """The browser's files by name (``index.html``, ``data/...``) from the two tables, in
    memory: the job writes them wherever its output lives."""
    latents = latents.sort_by("latent").to_pylist()
    contexts = contexts.append_column("band", pc.not_equal(contexts.column("kind"), "top"))
    contexts = contexts.sort_by([(c, "ascending") for c in ("latent", "band", "kind", "rank")])
    acts = contexts.column("acts").combine_chunks()
    flat = _rounded(acts.flatten().to_numpy(zero_copy_only=False))
    bounds = acts.offsets.to_numpy() - acts.offsets[0].as_py()
    columns = zip(*(contexts.column(c).to_pylist() for c in ("latent", "kind", "rank", "tokens",
                                                             "center")),
                  _rounded(contexts.column("value").to_numpy()), strict=True)  # fmt: skip
    by_latent: dict[int, list] = {}
    for i, (latent, kind, rank, words, center, value) in enumerate(columns):
        by_latent.setdefault(latent, []).append(
            [kind, rank, value, words, flat[bounds[i] : bounds[i + 1]], center]
        )
    rows = []
    for r in latents:
        top = [c[3][c[5]].strip() for c in by_latent.get(r["latent"], []) if c[0] == "top"]
        top = [t for t in top if t]
        rows.append([
            r["latent"], r["count"], _round(r["frequency"]), _round(r["mean"]), _round(r["max"]),
            r["dead"], r["dense"], r["hist"], list(dict.fromkeys(top))[:TOP_TOKENS],
        ])  # fmt: skip
    files: dict[str, bytes] = {}
    edges = histogram_edges(config.hist_bins, config.hist_min, config.hist_max)
    meta = {
        "title": title, "tokens": tokens, "chunk": CHUNK, "top_n": config.top_n,
        "dense_frequency": config.dense_frequency, "edges": [_round(e) for e in edges],
        "columns": ["latent", "count", "frequency", "mean", "max", "dead", "dense", "hist", "top"],
        "latents": rows,
    }  # fmt: skip
    files["data/latents.js"] = _js("FEATURE_DATA", meta).encode()
    for start in range(0, max(len(rows), 1), CHUNK):
        chunk = {str(i): by_latent[i] for i in range(start, start + CHUNK) if i in by_latent}
        script = "window.FEATURE_CONTEXTS = window.FEATURE_CONTEXTS || {};\n"
        script += (
            f"Object.assign(window.FEATURE_CONTEXTS, {json.dumps(chunk, separators=(',', ':'))});\n"
        )
        script += f"window.FEATURE_CHUNKS_LOADED = (window.FEATURE_CHUNKS_LOADED || []).concat([{start // CHUNK}]);\n"
        files[f"data/contexts-{start // CHUNK:04d}.js"] = script.encode()
    files["index.html"] = resources.files(__package__).joinpath("browser.html").read_bytes()
    return files


def image_browser_files(
    latents: pa.Table, contexts: pa.Table, images: pa.Table, layout, ground_truth: pa.Table | None,
    *, title: str, tokens: int, config: FeaturesConfig,
) -> dict[str, bytes]:  # fmt: skip
    """The browser of an image extraction (the same page, in its image mode): as
    ``browser_files``, each example an image (``data/img/{image_id}.png``, its thumbnail
    from ``images.parquet``) with the latent's activation on every token (``acts``,
    drawn as a heat map over the patch grid); the list's and the search's words are the
    labels (else the keys) of each latent's top images; ``ground_truth`` (a
    ``ground_truth.ground_truth_table``) adds its panel."""
    names = images.column_names
    meta_of = {}
    for row in images.to_pylist():
        label = row.get("label") if "label" in names else None
        meta_of[row["image_id"]] = [row.get("key"), None if label is None else str(label)]
    contexts = contexts.append_column("band", pc.not_equal(contexts.column("kind"), "top"))
    contexts = contexts.sort_by([(c, "ascending") for c in ("latent", "band", "kind", "rank")])
    acts = contexts.column("acts").combine_chunks()
    flat = _rounded(acts.flatten().to_numpy(zero_copy_only=False))
    bounds = acts.offsets.to_numpy() - acts.offsets[0].as_py()
    columns = zip(*(contexts.column(c).to_pylist() for c in ("latent", "kind", "rank", "image_id",
                                                             "token_pos")),
                  _rounded(contexts.column("value").to_numpy()), strict=True)  # fmt: skip
    by_latent: dict[int, list] = {}
    for i, (latent, kind, rank, image_id, pos, value) in enumerate(columns):
        by_latent.setdefault(latent, []).append(
            [kind, rank, value, image_id, pos, flat[bounds[i] : bounds[i + 1]]]
        )
    rows = []
    for r in latents.sort_by("latent").to_pylist():
        words = []
        for c in by_latent.get(r["latent"], []):
            if c[0] == "top":
                key, label = meta_of.get(c[3], [None, None])
                words.append(label if label is not None else str(key).rsplit("/", 1)[-1])
        rows.append([
            r["latent"], r["count"], _round(r["frequency"]), _round(r["mean"]), _round(r["max"]),
            r["dead"], r["dense"], r["hist"], list(dict.fromkeys(words))[:TOP_TOKENS],
        ])  # fmt: skip
    truth = []
    if ground_truth is not None:
        truth = [[t["factor"], t["value"], t["latent"], _round(t["auroc"]),
                  _round(t["second_auroc"]), _round(t["fires_inside"]), _round(t["fires_outside"]),
                  t["positives"], t["negatives"]]
                 for t in ground_truth.to_pylist()]  # fmt: skip
    edges = histogram_edges(config.hist_bins, config.hist_min, config.hist_max)
    meta = {
        "title": title, "tokens": tokens, "chunk": CHUNK, "top_n": config.top_n,
        "dense_frequency": config.dense_frequency, "edges": [_round(e) for e in edges],
        "columns": ["latent", "count", "frequency", "mean", "max", "dead", "dense", "hist", "top"],
        "latents": rows, "modality": "image", "layout": layout.to_dict(),
        "ground_truth": truth,
    }  # fmt: skip
    files: dict[str, bytes] = {"data/latents.js": _js("FEATURE_DATA", meta).encode()}
    for start in range(0, max(len(rows), 1), CHUNK):
        chunk = {str(i): by_latent[i] for i in range(start, start + CHUNK) if i in by_latent}
        shown = {c[3] for examples in chunk.values() for c in examples}
        described = {str(i): meta_of.get(i, [None, None]) for i in sorted(shown)}
        script = "window.FEATURE_CONTEXTS = window.FEATURE_CONTEXTS || {};\n"
        script += (
            f"Object.assign(window.FEATURE_CONTEXTS, {json.dumps(chunk, separators=(',', ':'))});\n"
        )
        script += "window.FEATURE_IMAGES = window.FEATURE_IMAGES || {};\n"
        script += f"Object.assign(window.FEATURE_IMAGES, {json.dumps(described, separators=(',', ':'))});\n"
        script += f"window.FEATURE_CHUNKS_LOADED = (window.FEATURE_CHUNKS_LOADED || []).concat([{start // CHUNK}]);\n"
        files[f"data/contexts-{start // CHUNK:04d}.js"] = script.encode()
    if "thumbnail" in names:
        for image_id, png in zip(images.column("image_id").to_pylist(),
                                 images.column("thumbnail").to_pylist(), strict=True):  # fmt: skip
            if png:
                files[f"data/img/{image_id}.png"] = bytes(png)
    files["index.html"] = resources.files(__package__).joinpath("browser.html").read_bytes()
    return files


def links_script(latents: dict, *, layer: int, pages: str) -> bytes:
    """``data/links.js`` of one layer's browser: ``latents`` maps a latent to its
    ``{"inputs": ..., "outputs": ...}`` (``graphs.global_weights.feature_links``' entries);
    ``pages`` is the pattern of a feature's page, relative to the browser's ``index.html``
    (``{layer}`` and ``{latent}`` stand for the feature's), e.g.
    ``"../../features-clt-layer{layer}/features/index.html#{latent}"``."""
    doc = {"pages": pages, "layer": layer, "latents": {str(k): v for k, v in latents.items()}}
    return _js("FEATURE_LINKS", doc).encode()
