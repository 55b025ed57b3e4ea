"""An SAE's or transcoder's activations on an extraction, as delphi's latent cache (the
input of EleutherAI's automatic interpretation, ``delphi.latents.LatentDataset``).

Layout, as delphi's ``LatentCache.save_splits`` and ``save_config`` write it (eai-delphi
0.1.3):

- ``{module}/{start}_{end}.safetensors``, one per split of the latents (delphi's
  boundaries: ``linspace(0, n_latents, n_splits + 1)``, ``end`` inclusive), holding
  ``locations`` ``[n, 3]`` (sequence, position, latent - ``start``; uint16 when the
  sequences and latents fit, else uint32, delphi's rule), ``activations`` ``[n]`` float16
  (every entry with ``|a| > 1e-5``, delphi's ``get_nonzeros``), ``tokens``
  ``[sequences, ctx_len]`` (the token ids; the same in every file);
- ``{module}/config.json``: delphi's ``CacheConfig`` fields and ``model_name``
  (``dataset_repo`` is the extraction, ``cache_ctx_len`` the sequences' length).

A sequence is one model input of the extraction (a ``(sample_id, window)`` of
``samples.parquet``, in its order), its tokens the extraction's tokenizer's on the
text, windowed as the extraction did (``max_length``, ``long_texts``), so a location's
position is the extraction's ``token_pos``. Shorter sequences are padded at the end
with the tokenizer's pad token (else its EOS, else 0): delphi holds tokens as one
rectangular array; the padding never carries an activation (the extraction made none
there), but delphi may show it in the context of a late example. The BOS the extraction
drops (``first_pos``) is in ``tokens`` and has no activation.

Single process: the dataset's rows are read and encoded a chunk at a time
(``features.scan``), the non-zero activations kept in memory (as delphi's own cache
keeps them) and written once; the output is published whole (``{module}/config.json``
last).

    export_delphi(DelphiConfig(extraction="out/acts", sae="out/sae.safetensors",
                               out="out/delphi/latents"))
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from .config import FeaturesConfig, FeaturesError

NONZERO = 1e-5
"""delphi's ``get_nonzeros``: an entry is kept when ``|activation| > 1e-5``."""


@dataclass(frozen=True)
class DelphiConfig:
    """An SAE's latents on an extraction as delphi's latent cache."""

    extraction: str
    """An extraction (``pyspark-safetensors extract``): a local directory or a URI."""
    sae: str
    """An SAE or transcoder file or directory (``sae.ecosystem.read_sae``), or a CLT with
    ``clt_layer``."""
    out: str
    """delphi's latents directory (its ``raw_dir``): ``{module}/...`` is written
    (replaced whole); a local path or a URI."""
    hook: str = ""
    """The hook point encoded; empty: the SAE's recorded one."""
    clt_layer: int = -1
    """A cross-layer transcoder's layer whose latents are cached (-1: not a CLT)."""
    module: str = ""
    """The module directory's name (delphi's hookpoint); empty: the hook point's module
    (``model.layers.0.mlp:input`` -> ``model.layers.0.mlp``)."""
    n_splits: int = 5
    """Files per module, each a contiguous range of latents (delphi's ``n_splits``)."""
    batch_tokens: int = 4096
    """Rows encoded at once."""
    device: str = ""
    """Torch device; empty: CUDA when available."""

    def __post_init__(self):
        if self.n_splits < 1 or self.batch_tokens < 1:
            raise FeaturesError("n_splits and batch_tokens must be >= 1")
        if "/" in self.module or self.module in (".", ".."):
            raise FeaturesError(f"module: a directory name, got {self.module!r}")


def split_bounds(n_latents: int, n_splits: int) -> list[tuple[int, int]]:
    """delphi's ``_generate_split_indices``: ``(start, end)`` with ``end`` inclusive."""
    import torch  # its float32 linspace, truncated, as delphi computes the bounds

    bounds = torch.linspace(0, n_latents, steps=n_splits + 1).long().tolist()
    return [(a, b - 1) for a, b in itertools.pairwise(bounds)]


def sequence_tokens(texts: Mapping[int, str], samples, tokenizer, max_length: int,
                    long_texts: str) -> list[list[int]]:  # fmt: skip
    """Each ``samples`` row's token ids (``sample_id``, ``window``, in order), the
    extraction's tokenizing: truncated at ``max_length``, a long text's overflow in
    further windows when ``long_texts`` is "window"."""
    windows: dict[tuple[int, int], list[int]] = {}
    ids = sorted({int(s) for s in samples["sample_id"]})
    for lo in range(0, len(ids), 256):  # as the extraction's tasks call it: a batch of texts
        batch = ids[lo : lo + 256]
        enc = tokenizer([texts[i] for i in batch], truncation=True, max_length=max_length,
                        return_overflowing_tokens=long_texts == "window", padding=False)  # fmt: skip
        mapping = enc.get("overflow_to_sample_mapping", list(range(len(batch))))
        seen: dict[int, int] = {}
        for r, input_ids in enumerate(enc["input_ids"]):
            window = seen.get(mapping[r], 0)
            seen[mapping[r]] = window + 1
            windows[(batch[mapping[r]], window)] = list(input_ids)
    out = []
    for s, w, first, n in zip(samples["sample_id"], samples["window"], samples["first_pos"],
                              samples["seq_len"], strict=True):  # fmt: skip
        ids = windows.get((int(s), int(w)))
        if ids is None or len(ids) != int(first) + int(n):
            raise FeaturesError(
                f"sample {s} window {w}: the extraction recorded {first} + {n} tokens, its "
                f"tokenizer gives {None if ids is None else len(ids)} here (another tokenizer?)"
            )
        out.append(ids)
    return out


def sequences_of(plan, samples: dict) -> tuple[np.ndarray, int]:
    """``(tokens [sequences, ctx_len], pad id)``: ``samples``' windows (sorted by
    ``sample_id``, ``window``) retokenized from the extraction's texts, padded at the end."""
    from .job import load_tokenizer, read_texts

    texts = read_texts(plan.extraction_location(), sorted(set(samples["sample_id"])))
    text_of = dict(zip(texts.column("sample_id").to_pylist(), texts.column("text").to_pylist(),
                       strict=True))  # fmt: skip
    tokenizer = load_tokenizer(plan.model_dir)
    sequences = sequence_tokens(text_of, samples, tokenizer, plan.max_length, plan.long_texts)
    ctx_len = max((len(s) for s in sequences), default=0)
    pad = next((t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id) if t is not None), 0)
    tokens = np.full((len(sequences), ctx_len), pad, np.int64)
    for i, ids in enumerate(sequences):
        tokens[i, : len(ids)] = ids
    return tokens, int(pad)


def nonzeros(plan, keys: np.ndarray, config: DelphiConfig) -> tuple[np.ndarray, np.ndarray]:
    """``(locations [n, 3] (sequence, position, latent), activations [n] float16)`` of
    every entry with ``|a| > NONZERO``, in row-major order; ``keys``: each sequence's
    ``sample_id << 20 | window``, sorted."""
    import torch

    from .job import load_encoder
    from .scan import RowReader, encoded_chunks
    from .state import split_ids

    device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
    sae = load_encoder(plan.sae, device, 0, plan.clt_layer)
    reader = RowReader(plan.open_input(), plan.width)
    parts: dict[str, list[np.ndarray]] = {"seq": [], "pos": [], "latent": [], "act": []}
    for chunk in encoded_chunks(reader, 0, len(reader.ds), sae, chunk=config.batch_tokens,
                                margin=0, device=device):  # fmt: skip
        values, latents = chunk.values.float().cpu().numpy(), chunk.indices.cpu().numpy()
        sample_id, window, pos = split_ids(chunk.ids.cpu().numpy())
        row = np.searchsorted(keys, sample_id << 20 | window)
        r, j = np.nonzero(np.abs(values) > NONZERO)
        parts["seq"].append(row[r])
        parts["pos"].append(pos[r])
        parts["latent"].append(latents[r, j].astype(np.int64))
        parts["act"].append(values[r, j])
    seq, pos, latent, act = (np.concatenate(parts[k]) if parts[k] else np.zeros(0, np.int64)
                             for k in ("seq", "pos", "latent", "act"))  # fmt: skip
    order = np.lexsort((latent, pos, seq))  # delphi's nonzero order: row-major
    return np.stack([seq, pos, latent], axis=1).astype(np.int64)[order], act[order].astype(
        np.float16
    )


def export_delphi(
    config: DelphiConfig, *, storage_options: Mapping[str, str] | None = None
) -> dict:
    """The cache (module docstring); returns ``{"module", "latents", "sequences",
    "ctx_len", "activations", "files"}``."""
    import pyarrow.parquet as pq
    from safetensors.numpy import save

    from ..dataset import DatasetLocation
    from ..dataset.publish import staged_output
    from .job import SAMPLES_TABLE, TEXTS_TABLE, plan_features

    options = dict(storage_options or {})
    features = FeaturesConfig(extraction=config.extraction, sae=config.sae, hook=config.hook,
                              clt_layer=config.clt_layer)  # fmt: skip
    plan = plan_features(features, options)
    if plan.layout is not None:
        raise FeaturesError(f"{config.extraction}: an image extraction; delphi's cache is text's")
    src = plan.extraction_location()
    samples = pq.read_table(src.path(SAMPLES_TABLE, what="file"), filesystem=src.fs)
    samples = samples.sort_by([("sample_id", "ascending"), ("window", "ascending")]).to_pydict()
    keys = np.asarray(samples["sample_id"], np.int64) << 20 | np.asarray(
        samples["window"], np.int64
    )
    tokens, pad = sequences_of(plan, samples)
    locations, act = nonzeros(plan, keys, config)
    module = config.module or plan.hook.split(":", 1)[0]
    target = DatasetLocation.of(config.out, storage_options=options)
    files = []
    with staged_output(target, f"{module}/config.json") as out:
        for start, end in split_bounds(plan.n_latents, config.n_splits):
            inside = (locations[:, 2] >= start) & (locations[:, 2] <= end)
            here = locations[inside].copy()
            here[:, 2] -= start
            small = len(here) == 0 or (here[:, 2].max() < 2**16 and here[:, 0].max() < 2**16)
            data = {"locations": here.astype(np.uint16 if small else np.uint32),
                    "activations": act[inside], "tokens": tokens}  # fmt: skip
            files.append(f"{module}/{start}_{end}.safetensors")
            out.staging.put_bytes(files[-1], save(data))
        cache_config = {
            "dataset_repo": str(config.extraction), "dataset_split": "", "dataset_name": "",
            "dataset_column": "text", "batch_size": len(tokens), "cache_ctx_len": tokens.shape[1],
            "n_tokens": int(tokens.size), "n_splits": config.n_splits,
            "model_name": plan.model_dir, "hook_point": plan.hook, "sae": str(config.sae),
            "pad_token_id": pad, "texts": src.display(TEXTS_TABLE),
        }  # fmt: skip
        out.staging.put_json(f"{module}/config.json", cache_config)
    return {"module": module, "latents": plan.n_latents, "sequences": len(tokens),
            "ctx_len": tokens.shape[1], "activations": len(act), "files": files}  # fmt: skip
