"""The static feature browser: ``index.html`` and ``data/*.js`` beside it, opened from
disk (no server, no network). The data are scripts assigning globals, since browsers
refuse ``fetch()`` of ``file://`` URLs: ``data/latents.js`` (every latent's statistics,
histogram and top tokens, for the list and the search) and ``data/contexts-NNNN.js``
(the examples of ``CHUNK`` latents each, loaded when a latent of theirs is opened)."""

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
