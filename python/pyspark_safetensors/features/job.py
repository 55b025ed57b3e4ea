"""The feature job: every token of a hook point's activation dataset encoded by an SAE
inside Spark tasks, per-latent state merged by Spark, examples decoded with the model's
tokenizer, two parquet tables and the browser published whole. A crosscoder reads several
hook points' row-aligned datasets (the same tokens), each row their rows concatenated in
its order; its examples are the first's tokens.

1. encode (``mapInArrow`` over row ranges): each task reads its range of the dataset's
   shards itself (``scan``: the bytes do not cross the JVM), folds its tokens into a
   ``LatentState`` (bounded memory), each kept candidate with its context window (the
   latent's activation on the +-``context`` tokens around it, taken from the chunk's
   code), and emits it as rows: statistics per (latent, bin), top-N candidates, sample
   candidates; written under the staging directory (a local output) or kept on the
   executors' disks (``persist``, an output elsewhere);
2. merge (Spark): sums and maxima per cell, ``row_number`` windows keep the global top-N
   per latent and the bottom-R priorities per (latent, bin); the driver receives
   O(latents x (N + bins x R)) rows (each with its window), never activations;
3. contexts: the texts of the example samples are tokenized (Spark) and only the tokens
   of the examples' windows come back; each example's row is assembled on the driver.
   A dataset not in token order (not an extraction's) has no windows from the first
   pass: a second pass re-encodes the example samples then (``windows_from_codes``);
4. outputs: the two tables (small: one row per latent, one per example) and the browser
   are made on the driver and written through ``DatasetLocation``, ``features.json``
   last: locally into a staging directory published by one rename, on an object store
   (``s3://``, any pyarrow or fsspec filesystem) in place, after everything was computed.

The extraction may live on any such storage too: the tasks read its activation dataset
through ``DatasetLocation`` (ranged reads on an object store), as the driver reads
``extraction.json`` and the texts of the example samples (Spark's own JSON reader is
used for a local ``texts.jsonl``).

An image extraction (``extraction.json``'s ``modality`` "image") is shown as images: an
example's window is its whole image (the latent's activation on every token: the heat
map over the patch grid), the top examples are distinct images, and the thumbnails of
the example images come from ``images.parquet`` (``images``). With ``factors`` (per-patch
labels of generative factors) the tasks also keep the code of the labelled patches, and
``ground_truth`` finds each factor value's best latent by AUROC.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from .._version import __version__
from ..dataset import DatasetLocation
from ..spark.compat import default_parallelism, from_arrow, to_arrow
from .config import FeaturesConfig, FeaturesError
from .ground_truth import (
    GROUND_TRUTH_FILE,
    FactorLabels,
    PatchCodes,
    code_matrix,
    ground_truth_table,
    read_factors,
)
from .images import (
    IMAGES_TABLE,
    ImageLayout,
    check_layout,
    image_contexts_table,
    layout_of,
    read_images,
)
from .merge import contexts_table, examples_table, latents_table, list_array
from .scan import RowReader, encoded_chunks, fold, row_ranges
from .state import (
    POS_BITS,
    WINDOW_BITS,
    LatentState,
    histogram_edges,
    priority,
    split_ids,
    token_ids,
)

CANDIDATES_SCHEMA = (
    "kind byte, latent int, cell long, value float, token long, priority long, "
    "count long, total double, context array<float>"
)
STAT, MAXIMUM, TOKENS, TOP, SAMPLE, OUT_OF_ORDER, CODE, LABELLED = 0, 1, 2, 3, 4, 5, 6, 7
ROWS_PER_TASK = 1 << 20
"""Most rows one encode task scans (more tasks than cores past that: retries stay small)."""
CODES_SCHEMA = "sample_id long, window int, token_pos int, latents array<int>, acts array<float>"
TOKENS_SCHEMA = "sample_id long, window int, pos int, token string"
TOKENS_ARROW = pa.schema([("sample_id", pa.int64()), ("window", pa.int32()), ("pos", pa.int32()),
                          ("token", pa.string())])  # fmt: skip
EXTRACTION_DOC, SAMPLES_TABLE, TEXTS_TABLE = "extraction.json", "samples.parquet", "texts.jsonl"
FEATURES_DOC = "features.json"
"""Written last: its presence marks a finished output (it lists every other file)."""
LATENTS_FILE = "latents.parquet/part-00000.parquet"
CONTEXTS_FILE = "contexts.parquet/part-00000.parquet"
"""The tables, each a directory of one part file (as Spark's writer lays a table out)."""


@dataclass(frozen=True)
class FeaturesPlan:
    """What the job reads, checked before any task runs."""

    dataset: str
    """The hook point's activation dataset: a local path or a URI (a crosscoder's: its
    first hook point's, whose tokens and windows the examples are)."""
    hook: str
    """The hook point (a crosscoder's: its hook points joined by " + ")."""
    width: int
    n_latents: int
    k: int | None
    """The SAE's k (None: a JumpReLU SAE, whose thresholds pick its code)."""
    architecture: str
    sae: str
    model_dir: str
    max_length: int
    long_texts: str
    extraction: str
    """The extraction: a local directory or a URI."""
    storage_options: Mapping[str, str] = field(default_factory=dict)
    """For a URI: ``endpoint_url``, ``region``, ... (``DatasetLocation.of``)."""
    layout: ImageLayout | None = None
    """An image extraction's token layout; None for text."""
    token_kinds: tuple[str, ...] = ()
    """An image extraction's kinds of token that enter the statistics and the examples
    (empty: all)."""
    inputs: tuple[str, ...] = ()
    """A crosscoder's datasets in its block order (``dataset`` first), row-aligned: its
    input is their rows concatenated; empty for an SAE (``dataset`` alone)."""
    clt_layer: int = -1
    """A cross-layer transcoder's layer whose encoder the tasks use (-1: not a CLT)."""

    @property
    def span(self) -> int:
        """Tokens of an image (an example's window), 0 for text."""
        return self.layout.tokens if self.layout else 0

    def positions(self) -> torch.Tensor | None:
        """A bool per token position: those of ``token_kinds`` (None: every token)."""
        if not self.token_kinds:
            return None
        return torch.tensor([kind in self.token_kinds for kind in self.layout.kinds()])

    def extraction_location(self) -> DatasetLocation:
        return DatasetLocation.of(self.extraction, storage_options=self.storage_options)

    def open_input(self):
        """What the encoder reads (``scan.RowReader``'s dataset): ``dataset`` opened, or a
        crosscoder's ``inputs`` as one ``AlignedDatasets`` (row counts, shard layout and a
        sample of their tokens checked on opening: a ``MisalignedDatasetsError`` names
        both datasets)."""
        from ..torch import open_dataset
        from ..torch.loader import AlignedDatasets

        options = dict(self.storage_options) or None
        if not self.inputs:
            return open_dataset(self.dataset, storage_options=options)
        names = {f"block{i}": path for i, path in enumerate(self.inputs)}
        return AlignedDatasets(
            {name: (open_dataset(path, storage_options=options), "activation")
             for name, path in names.items()}, names=names,
        )  # fmt: skip


def plan_features(
    config: FeaturesConfig, storage_options: Mapping[str, str] | None = None
) -> FeaturesPlan:
    """Check the inputs (one-line errors naming the file or setting) and resolve the hook,
    the widths and the tokenizer. ``config.extraction`` may be a URI (``s3://...``);
    ``storage_options`` configure its filesystem (else the usual ``AWS_*`` variables)."""
    options = dict(storage_options or {})
    src = DatasetLocation.of(config.extraction, storage_options=options)
    doc = read_extraction_doc(config, src)
    doc_path = src.display(EXTRACTION_DOC)
    cls, info, n, d = sae_architecture(config)
    architecture = cls.ARCHITECTURE
    hook, dataset, inputs = hook_and_dataset(config, info, doc, src, architecture, d)
    if info["k"] is None and cls.SELECTS_TOP_K:
        raise FeaturesError(
            f"{config.sae}: a {architecture} SAE that records no k (its top-k selection "
            "needs one); record k in its metadata or config"
        )
    cfg = doc["config"]
    model_dir, layout = model_and_layout(doc, doc_path, dataset, options)
    plan = FeaturesPlan(
        dataset=dataset, hook=hook, width=d, n_latents=n,
        k=info["k"], architecture=architecture, sae=str(config.sae), model_dir=model_dir,
        max_length=int(cfg.get("max_length", 0)), long_texts=cfg.get("long_texts", "window"),
        extraction=src.root if src.is_local else src.uri, storage_options=options, layout=layout,
        token_kinds=tuple(config.token_kinds), inputs=inputs, clt_layer=config.clt_layer,
    )  # fmt: skip
    if inputs:  # the datasets' row layout and a sample of their tokens, before any task
        shapes = [list(ds.manifest.schema[c].sample_shape)
                  for ds, c in plan.open_input().parts.values()]  # fmt: skip
        if any(len(s) != 1 for s in shapes) or sum(s[0] for s in shapes) != d:
            raise FeaturesError(
                f"{config.sae}: a crosscoder of input width {d}; its datasets {list(inputs)} "
                f"have rows of {shapes}"
            )
    return plan


def is_image_extraction(doc: dict) -> bool:
    """The extraction document ``doc`` describes an image extraction (modality 'image')."""
    return doc.get("modality", "text") == "image"


def read_extraction_doc(config: FeaturesConfig, src: DatasetLocation) -> dict:
    """The extraction document at ``src``, checked: it exists, the image-only options are
    set only for an image extraction, and the token tables its modality needs are there."""
    doc_path = src.display(EXTRACTION_DOC)
    if not src.has(EXTRACTION_DOC):
        raise FeaturesError(f"{doc_path}: no extraction here (run `pyspark-safetensors extract`)")
    doc = json.loads(src.read_bytes(EXTRACTION_DOC))
    image = is_image_extraction(doc)
    for option in ("factors", "token_kinds"):
        if getattr(config, option) and not image:
            raise FeaturesError(
                f"{option}: {doc_path} is not an image extraction (modality 'image')"
            )
    for table in (IMAGES_TABLE,) if image else (SAMPLES_TABLE, TEXTS_TABLE):
        if not src.has(table):
            raise FeaturesError(f"{src.display(table)}: missing token table; re-run the extraction")
    return doc


def sae_architecture(config: FeaturesConfig):
    """The architecture class of ``config.sae``, its ``info`` (``read_sae``'s), its latent
    count and input width."""
    from ..sae.architectures import get_architecture
    from ..sae.ecosystem import read_sae

    tensors, info = read_sae(config.sae)
    shape = tensors["encoder_weight"].shape  # a CLT's: [layers, n, d]
    del tensors  # the tasks load the SAE themselves
    try:
        cls = get_architecture(info["architecture"])
    except ValueError as e:
        raise FeaturesError(f"{config.sae}: {e}") from None
    clt = cls.ARCHITECTURE == "clt"
    if clt and not 0 <= config.clt_layer < shape[0]:
        raise FeaturesError(
            f"clt_layer: {config.sae} is a cross-layer transcoder of {shape[0]} layers; "
            f"set clt_layer to one of 0..{shape[0] - 1}, got {config.clt_layer}"
        )
    if not clt and config.clt_layer != -1:
        raise FeaturesError(
            f"clt_layer: {config.sae} is a {cls.ARCHITECTURE} SAE, not a cross-layer transcoder"
        )
    n, d = shape[-2:]
    return cls, info, n, d


def hook_and_dataset(
    config: FeaturesConfig, info: dict, doc: dict, src: DatasetLocation, architecture: str, d: int
) -> tuple[str, str, tuple[str, ...]]:
    """The hook point the SAE reads, the dataset of its activations and, for a crosscoder,
    its input datasets (its hook is their names joined by ``+``, its dataset the first);
    an SAE's hook is ``config.hook``, else its metadata's, else the extraction's only one,
    and its width must be the SAE's input width ``d``."""
    doc_path = src.display(EXTRACTION_DOC)
    hooks = doc["hooks"]
    if architecture == "crosscoder":
        inputs, names = crosscoder_inputs(config, info, doc, src)
        return " + ".join(names), inputs[0], inputs
    if config.datasets:
        raise FeaturesError(
            f"datasets: {config.sae} is a {architecture} SAE, which reads one hook point "
            "(set hook); datasets are a crosscoder's"
        )
    hook = config.hook or recorded_hook(info, config.clt_layer)
    if not hook and len(hooks) == 1:
        hook = next(iter(hooks))
    if hook not in hooks:
        raise FeaturesError(
            f"hook point {hook!r} is not in {doc_path} (it has {sorted(hooks)}); set --hook"
        )
    width = int(hooks[hook]["width"])
    if width != d:
        raise FeaturesError(
            f"{config.sae}: SAE input width {d} differs from {hook}'s width {width} in {src}"
        )
    dataset = hooks[hook]["dataset"]
    return hook, src.local_file(dataset) or src.display(dataset), ()


def recorded_hook(info: dict, clt_layer: int = -1) -> str:
    """The hook point an SAE's metadata records (a CLT's: that of layer ``clt_layer``,
    from its ``hook_points``); empty when none."""
    meta = info.get("metadata") or {}
    if clt_layer < 0:
        return meta.get("hook_point", "")
    hooks = meta.get("hook_points") or []
    hooks = json.loads(hooks) if isinstance(hooks, str) else list(hooks)
    return hooks[clt_layer] if clt_layer < len(hooks) else ""


def model_and_layout(doc: dict, doc_path: str, dataset: str, options: dict):
    """The model directory the tasks load (absolute; a text extraction's tokenizer, its
    recorded model resolved when the directory is gone) and, for an image extraction, the
    layout of an image's tokens (checked against ``dataset``) instead of a tokenizer."""
    model_dir = doc.get("model_dir") or ""
    layout = None
    if is_image_extraction(doc):  # no tokenizer: the layout of an image's tokens instead
        from ..torch import open_dataset

        layout = layout_of(doc, doc_path)
        check_layout(layout, open_dataset(dataset, storage_options=options or None), dataset)
    elif not Path(model_dir, "config.json").is_file():
        from ..extract import resolve_model

        model_dir = str(resolve_model(doc["config"].get("model", "")).path)
    if model_dir:  # the tasks' working directory need not be the driver's
        model_dir = os.path.abspath(model_dir)
    return model_dir, layout


def crosscoder_inputs(config: FeaturesConfig, info: dict, doc: dict, src: DatasetLocation):
    """A crosscoder's datasets (in its block order) and their names: ``config.datasets``;
    else its recorded hook points' datasets in the extraction (as an SAE's hook point),
    when the extraction has them all; else the datasets its checkpoint's config trained
    it on. One per block, or a ``FeaturesError`` saying what to give."""
    meta = info.get("metadata") or {}
    recorded = meta.get("hook_points") or []
    recorded = json.loads(recorded) if isinstance(recorded, str) else list(recorded)
    blocks = int(meta.get("blocks") or len(recorded))
    hooks = doc["hooks"]
    if config.hook:
        raise FeaturesError(
            f"hook: {config.sae} is a crosscoder, which reads several hook points; give "
            "datasets (one per hook point, in its order) or leave both empty"
        )
    if config.datasets:
        paths, origin = tuple(config.datasets), "datasets"
    elif recorded and all(h in hooks for h in recorded):
        paths = tuple(src.local_file(hooks[h]["dataset"]) or src.display(hooks[h]["dataset"])
                      for h in recorded)  # fmt: skip
        return paths, tuple(recorded)
    else:
        trained = (meta.get("config") or {}).get("datasets") or ()
        paths, origin = tuple(trained), f"{config.sae}'s training config"
        if not paths:
            raise FeaturesError(
                f"{config.sae}: a crosscoder whose hook points {recorded} are not all in "
                f"{src.display(EXTRACTION_DOC)} (it has {sorted(hooks)}) and whose config "
                "names no datasets; give datasets (one per hook point, in its order)"
            )
    if blocks and len(paths) != blocks:
        raise FeaturesError(
            f"{origin}: {len(paths)} dataset(s) {list(paths)} for a crosscoder of {blocks} "
            "hook points; give one per hook point, in its order"
        )
    names = recorded if len(recorded) == len(paths) and all(recorded) else paths
    return paths, tuple(names)


_SAES: dict = {}


class CLTLayerEncoder:
    """One layer of a cross-layer transcoder as the job's encoder: ``encode(x)`` is the
    ``(values, indices)`` of the top k of that layer's code under its top-k rule
    (``CrossLayerTranscoder.encode_layer``), as a TopK SAE's ``encode`` gives them."""

    def __init__(self, clt, layer: int):
        self.clt, self.layer = clt, layer

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values, indices = self.clt.encode_layer(self.layer, x).topk(self.clt.k, dim=1)
        return values, indices


def load_encoder(sae: str, device: str, threads: int = 0, layer: int = -1):
    """The SAE as its architecture's module (``load_sae_model``: TopK, BatchTopK or
    JumpReLU, each encoding by its own rule) on ``device``, once per Python worker; a
    cross-layer transcoder's layer ``layer`` as a ``CLTLayerEncoder``."""
    from ..sae.ecosystem import load_sae_model

    if threads:
        torch.set_num_threads(threads)
    key = (sae, device)
    if key not in _SAES:
        _SAES.clear()
        _SAES[key] = load_sae_model(sae, device=device)
    return _SAES[key] if layer < 0 else CLTLayerEncoder(_SAES[key], layer)


def pick_device(config: FeaturesConfig) -> str:
    return config.device or ("cuda" if torch.cuda.is_available() else "cpu")


def activations_of(batch: pa.RecordBatch, width: int) -> np.ndarray:
    """The batch's ``activation`` rows (``array<float>``, as the reader gives them: F16 and
    BF16 widened) as float32 ``[rows, width]``; the values lie back to back."""
    column = batch.column("activation")
    if len(column) == 0:
        return np.zeros((0, width), np.float32)
    values = column.flatten().to_numpy(zero_copy_only=False).astype(np.float32, copy=False)
    x = values.reshape(len(column), -1)
    if x.shape[1] != width:
        raise FeaturesError(f"activation rows have width {x.shape[1]}, the SAE {width}")
    return x if x.flags.writeable else x.copy()  # torch wants writable memory


def scalars_of(batch: pa.RecordBatch, name: str) -> np.ndarray:
    """A per-token column (``sample_id``, ``window``, ``token_pos``) as int64."""
    return batch.column(name).to_numpy(zero_copy_only=False).astype(np.int64)


def encode_batches(batches, sae, width: int, batch_tokens: int, device: str):
    """``(values, indices, ids)`` per chunk of ``batch_tokens`` tokens of Arrow batches:
    the SAE's own code, ``[B, m]`` each (``m`` = k for TopK, at most 4k for BatchTopK, and
    for JumpReLU the most latents one token of the chunk fires; unused slots hold 0)."""
    for big in batches:
        for offset in range(0, big.num_rows, batch_tokens):
            b = big.slice(offset, batch_tokens)
            x = torch.from_numpy(activations_of(b, width)).to(device)
            ids = token_ids(*(scalars_of(b, c) for c in ("sample_id", "window", "token_pos")))
            with torch.inference_mode():
                values, indices = sae.encode(x)
            yield values, indices, torch.from_numpy(ids)


def new_state(plan: FeaturesPlan, config: FeaturesConfig) -> LatentState:
    edges = torch.from_numpy(histogram_edges(config.hist_bins, config.hist_min, config.hist_max))
    return LatentState(plan.n_latents, config.top_n, config.samples_per_band, edges, config.seed,
                       window=plan.span or 2 * config.context + 1,
                       distinct=plan.layout is not None)  # fmt: skip


def scan_range(state: LatentState, reader: RowReader, start: int, stop: int, sae,
               config: FeaturesConfig, device: str, *, span: int = 0,
               codes: PatchCodes | None = None, positions=None) -> None:  # fmt: skip
    """Rows ``[start, stop)`` of the dataset encoded and folded into ``state`` (``span``:
    an image's tokens, for an image extraction; ``positions``: the token positions that
    enter it, ``FeaturesPlan.positions``); ``codes`` keeps the code of its tokens."""
    chunks = encoded_chunks(reader, start, stop, sae, chunk=config.batch_tokens,
                            margin=config.context, device=device, span=span)  # fmt: skip
    fold(state, chunks if codes is None else map(codes.tap, chunks), positions)


def _encode_fn(plan: FeaturesPlan, config: FeaturesConfig, dataset, ranges, labelled=None):
    """The task: its row ranges (``ranges[id]`` of the input's ``id`` column) of
    ``dataset`` (a ``torch.SafetensorsDataset``) folded into one state, emitted as
    candidate rows; with ``labelled`` (token ids), also the code of those tokens."""

    def run(batches):
        device = pick_device(config)
        sae = load_encoder(plan.sae, device, config.threads, plan.clt_layer)
        reader = RowReader(dataset, plan.width)
        state = new_state(plan, config)
        codes = None if labelled is None else PatchCodes(labelled)
        for batch in batches:
            for task in batch.column("id").to_pylist():
                scan_range(state, reader, *ranges[task], sae, config, device, span=plan.span,
                           codes=codes, positions=plan.positions())  # fmt: skip
        yield from state_rows(state, codes)

    return run


def state_rows(state: LatentState, codes: PatchCodes | None = None):
    """A state (and the labelled tokens' codes) as ``CANDIDATES_SCHEMA`` batches."""

    def batch(kind, latent, cell=None, value=None, token=None, prio=None, count=None, total=None,
              ctx=None):  # fmt: skip
        m = len(latent)
        zeros = np.zeros(m, np.int64)
        ctx = np.zeros((m, 0), np.float32) if ctx is None else np.asarray(ctx, np.float32)
        return pa.RecordBatch.from_pydict({
            "kind": pa.array(np.full(m, kind, np.int8)),
            "latent": pa.array(np.asarray(latent, np.int32)),
            "cell": pa.array(zeros if cell is None else np.asarray(cell, np.int64)),
            "value": pa.array(np.zeros(m, np.float32) if value is None else np.asarray(value, np.float32)),
            "token": pa.array(zeros if token is None else np.asarray(token, np.int64)),
            "priority": pa.array(zeros if prio is None else np.asarray(prio, np.int64)),
            "count": pa.array(zeros if count is None else np.asarray(count, np.int64)),
            "total": pa.array(np.zeros(m) if total is None else np.asarray(total, np.float64)),
            "context": list_array(ctx.reshape(-1), np.full(m, ctx.shape[1])),
        })  # fmt: skip

    cells = torch.nonzero(state.counts).flatten()
    yield batch(STAT, (cells // state.bins).numpy(), cells.numpy(), count=state.counts[cells].numpy(),
                total=state.sums[cells].numpy())  # fmt: skip
    fired = torch.nonzero(state.maxima).flatten()
    yield batch(MAXIMUM, fired.numpy(), value=state.maxima[fired].numpy())
    yield batch(TOKENS, [-1], count=[state.tokens])
    yield batch(OUT_OF_ORDER, [-1], count=[state.out_of_order])
    t, s = state.top, state.samples
    yield batch(TOP, t["latent"].numpy(), value=t["value"].numpy(), token=t["id"].numpy(),
                ctx=t["ctx"].numpy())  # fmt: skip
    prio = priority(s["id"], s["latent"], state.seed)
    yield batch(SAMPLE, s["latent"].numpy(), s["cell"].numpy(), s["value"].numpy(), s["id"].numpy(),
                prio.numpy(), ctx=s["ctx"].numpy())  # fmt: skip
    if codes is not None:
        token, latent, value = codes.entries()
        yield batch(CODE, latent, value=value, token=token)
        yield batch(LABELLED, [-1], count=[codes.seen])


def _codes_fn(plan: FeaturesPlan, config: FeaturesConfig):
    """The task of the second pass (``windows_from_codes``): each token's sparse code,
    its firing latents and their activations (the unused slots of a code, zeros, are
    dropped)."""

    def run(batches):
        device = pick_device(config)
        sae = load_encoder(plan.sae, device, config.threads, plan.clt_layer)
        for big in batches:
            for values, indices, ids in encode_batches([big], sae, plan.width,
                                                       config.batch_tokens, device):  # fmt: skip
                sample_id, window, pos = split_ids(ids.numpy())
                fired = (values > 0).cpu()
                lengths = fired.sum(1).numpy()
                yield pa.RecordBatch.from_pydict({
                    "sample_id": pa.array(sample_id),
                    "window": pa.array(window.astype(np.int32)),
                    "token_pos": pa.array(pos.astype(np.int32)),
                    "latents": list_array(indices.cpu()[fired].numpy().astype(np.int32), lengths),
                    "acts": list_array(values.float().cpu()[fired].numpy(), lengths),
                })  # fmt: skip

    return run


def display_tokens(text: str, offsets, pieces: list[str]) -> list[str]:
    """Each token as a reader sees it: the text it covers with the whitespace before it
    (``" the"`` whether the tokenizer wrote ``the``, ``Ġthe`` or ``▁the``; ``"ing"`` for
    ``##ing``), so the tokens of a context joined are its text; a special token (no span in
    the text, e.g. ``[CLS]``, ``<s>``) as itself. ``offsets``: the fast tokenizer's
    character spans of ``pieces``."""
    out, previous = [], None
    for (start, end), piece in zip(offsets, pieces, strict=True):
        if end <= start:
            out.append(piece)
            continue
        begin = start if previous is None or previous > start else previous
        out.append(text[begin:end])
        previous = end
    return out


_TOKENIZERS: dict = {}


def load_tokenizer(model_dir: str):
    """The model's tokenizer, once per Python worker."""
    if model_dir not in _TOKENIZERS:
        from transformers import AutoTokenizer

        _TOKENIZERS.clear()
        _TOKENIZERS[model_dir] = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    return _TOKENIZERS[model_dir]


def tokenize_fn(plan: FeaturesPlan, wanted: Mapping[tuple[int, int], list[int]], context: int):
    """Texts -> one row per token of each model input, as the extraction tokenized them
    (same tokenizer, ``max_length`` and windows), kept only within ``context`` tokens of
    a ``token_pos`` in ``wanted[(sample_id, window)]``; ``token`` is its text as a reader
    sees it (``display_tokens``)."""

    def run(batches):
        tokenizer = load_tokenizer(plan.model_dir)
        for batch in batches:
            texts = batch.column("text").to_pylist()
            enc = tokenizer(
                texts, truncation=True, max_length=plan.max_length,
                return_overflowing_tokens=plan.long_texts == "window", padding=False,
                return_offsets_mapping=tokenizer.is_fast,
            )  # fmt: skip
            ids = batch.column("sample_id").to_pylist()
            mapping = enc.get("overflow_to_sample_mapping", list(range(len(ids))))
            seen: dict[int, int] = {}
            cols: dict[str, list] = {"sample_id": [], "window": [], "pos": [], "token": []}
            for r, input_ids in enumerate(enc["input_ids"]):
                window = seen.get(mapping[r], 0)
                seen[mapping[r]] = window + 1
                pieces = tokenizer.convert_ids_to_tokens(input_ids)
                if tokenizer.is_fast:
                    tokens = display_tokens(texts[mapping[r]], enc["offset_mapping"][r], pieces)
                else:  # no character spans: each token decoded alone
                    tokens = [tokenizer.convert_tokens_to_string([p]) for p in pieces]
                keep = np.zeros(len(tokens), bool)
                for pos in wanted.get((ids[mapping[r]], window), ()):
                    keep[max(pos - context, 0) : pos + context + 1] = True
                kept = np.flatnonzero(keep).tolist()
                cols["sample_id"] += [ids[mapping[r]]] * len(kept)
                cols["window"] += [window] * len(kept)
                cols["pos"] += kept
                cols["token"] += [tokens[i] for i in kept]
            yield pa.RecordBatch.from_pydict(cols, schema=TOKENS_ARROW)

    return run


@dataclass
class FeaturesSummary:
    out: Path | str
    """The output: a local directory, or the URI it was given as."""
    hook: str
    tokens: int
    latents: int
    dead: int
    dense: int
    encode_seconds: float
    seconds: float
    l0: float = 0.0
    """Mean number of latents a token fires (TopK: at most k; JumpReLU: what its
    thresholds give)."""
    second_pass: bool = False
    """Whether the windows came from a second pass over the example samples (a dataset
    whose rows are not in token order)."""
    modality: str = "text"
    """The extraction's: "text" or "image"."""
    ground_truth: list = field(default_factory=list)
    """With ``factors``: per factor value, its best latent and AUROC (the rows of
    ``ground_truth.parquet``)."""

    @property
    def tokens_per_s(self) -> float:
        """Tokens per second of the encode-and-merge pass (the statistics, the examples and
        their windows)."""
        return self.tokens / max(self.encode_seconds, 1e-9)

    def __str__(self) -> str:
        return (
            f"{self.out}: {self.latents:,} latents of {self.hook} over {self.tokens:,} tokens "
            f"({self.dead} dead, {self.dense} dense, L0 {self.l0:.1f}), "
            f"{self.tokens_per_s:,.0f} tokens/s, {self.seconds:.1f} s in all"
        )


def run_features(
    spark, config: FeaturesConfig, *, storage_options: Mapping[str, str] | None = None
) -> FeaturesSummary:
    """Compute every latent's statistics and examples over the whole dataset and publish
    ``latents.parquet``, ``contexts.parquet``, the browser and ``features.json`` at
    ``config.out``. A failed job leaves nothing there: a local output is built under a
    staging name and renamed; on an object store (``config.out`` a URI such as
    ``s3://bucket/features``) everything is computed first, then the previous output (with
    ``overwrite``) is deleted, the files put, ``features.json`` last, and a failure while
    putting deletes what was put. ``config.extraction`` may be a URI too;
    ``storage_options`` (``endpoint_url``, ``region``, ...) configure both filesystems."""
    from ..dataset.publish import publishing

    plan = plan_features(config, storage_options)
    if not config.out:
        raise FeaturesError("out is empty: give an output directory (--out)")
    target = DatasetLocation.of(config.out, storage_options=plan.storage_options)
    exists = os.path.exists(target.root) if target.is_local else target.exists()
    if exists and not config.overwrite:
        raise FeaturesError(f"{config.out} exists; pass overwrite=True (--overwrite) to replace it")
    started = time.perf_counter()
    if target.is_local:
        with publishing(target.root) as tmp:
            # a name Spark lists (it skips "_" and "."), removed before publishing
            result = _compute(spark, plan, config, started, scratch=tmp / "candidates")
            _write_files(DatasetLocation.of(tmp), result)
        out: Path | str = Path(target.root)
    else:
        result = _compute(spark, plan, config, started, scratch=None)
        _write_in_place(target, result)
        out = target.uri
    return FeaturesSummary(out, **result.figures)


@dataclass
class _Outputs:
    """Everything the job publishes, made before anything is written."""

    files: dict[str, bytes]
    """By name relative to the output: the tables and the browser."""
    doc: dict
    """``features.json``."""
    figures: dict
    """The ``FeaturesSummary`` fields but ``out``."""


def _compute(spark, plan: FeaturesPlan, config: FeaturesConfig, started: float, *, scratch):
    """The steps (module docstring) and the output files, in memory. ``scratch``:
    a local directory for the tasks' states (a local output's staging directory), or
    None to keep them on the executors' disks."""
    from pyspark import StorageLevel

    from .page import browser_files, image_browser_files

    dataset = plan.open_input()
    source = plan.extraction_location()
    labels = None
    if config.factors:
        keys = read_images(source, None, ("image_id", "key", "path")) if plan.layout else None
        labels = read_factors(config.factors, plan.layout, keys)
    cores = default_parallelism(spark)
    tasks = max(cores, -(-len(dataset) // ROWS_PER_TASK))
    ranges = row_ranges(len(dataset), tasks, config.batch_tokens)
    encoded = spark.range(0, len(ranges), 1, len(ranges)).mapInArrow(
        _encode_fn(plan, config, dataset, ranges, None if labels is None else labels.ids),
        CANDIDATES_SCHEMA,
    )
    if scratch is not None:
        encoded.write.parquet(str(scratch))
        candidates = spark.read.parquet(str(scratch))
    else:
        candidates = encoded.persist(StorageLevel.DISK_ONLY)
    try:
        state = merged_state(candidates, plan, config)
        truth = None if labels is None else ground_truth_of(candidates, labels, plan)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
        else:
            candidates.unpersist()
    encode_seconds = time.perf_counter() - started
    latents = latents_table(state, config)
    examples = examples_table(state, config)
    if state.out_of_order:  # no windows from the first pass: a second one
        examples = windows_from_codes(spark, examples, plan, config)
    title = f"{plan.hook} · {Path(plan.sae).name}"
    if plan.layout is not None:
        contexts = image_contexts_table(examples, plan.layout)
        images = read_images(source, contexts.column("image_id").to_numpy())
        files = {LATENTS_FILE: parquet_bytes(latents), CONTEXTS_FILE: parquet_bytes(contexts)}
        files |= image_browser_files(latents, contexts, images, plan.layout, truth, title=title,
                                     tokens=state.tokens, config=config)  # fmt: skip
    else:
        tokens = example_tokens(spark, examples, plan, config, partitions=cores)
        contexts = contexts_table(examples, tokens, config.context)
        files = {LATENTS_FILE: parquet_bytes(latents), CONTEXTS_FILE: parquet_bytes(contexts)}
        files |= browser_files(latents, contexts, title=title, tokens=state.tokens, config=config)
    if truth is not None:
        files[GROUND_TRUTH_FILE] = parquet_bytes(truth)
    figures = {
        "hook": plan.hook, "tokens": state.tokens, "latents": plan.n_latents,
        "dead": int(np.sum(latents.column("dead").to_numpy(zero_copy_only=False))),
        "dense": int(np.sum(latents.column("dense").to_numpy(zero_copy_only=False))),
        "encode_seconds": encode_seconds, "seconds": time.perf_counter() - started,
        "l0": float(state.counts.sum()) / max(state.tokens, 1),
        "second_pass": bool(state.out_of_order),
        "modality": "image" if plan.layout else "text",
        "ground_truth": [] if truth is None else truth.to_pylist(),
    }  # fmt: skip
    doc = {
        "config": config.to_dict(), "extraction": plan.extraction, "dataset": plan.dataset,
        **({"datasets": list(plan.inputs)} if plan.inputs else {}), "sae": plan.sae, "architecture": plan.architecture, "k": plan.k,
        "summary": figures, "files": sorted(files), "version": __version__,
    }  # fmt: skip
    return _Outputs(files, doc, figures)


def parquet_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue().to_pybytes()


def _write_files(out: DatasetLocation, result: _Outputs) -> None:
    """Every file, each in one atomic put, ``features.json`` last."""
    for name, data in result.files.items():
        out.put_bytes(name, data)
    out.put_json(FEATURES_DOC, result.doc)


def _write_in_place(target: DatasetLocation, result: _Outputs) -> None:
    """An output on an object store (no rename there): the previous one's
    ``features.json`` is deleted first, so it stops looking finished, then the rest of it;
    the new files are put, ``features.json`` last. A failure deletes what was put."""
    target.delete([FEATURES_DOC])
    target.delete(list(target.list()))
    try:
        _write_files(target, result)
    except BaseException:
        target.delete(list(target.list()))
        target.remove_if_empty()
        raise


def tokens_frame(spark, plan: FeaturesPlan, needed=None):
    """The hook point's tokens (``activation, sample_id, window, token_pos``) through the
    ``safetensors`` data source (any storage), only those of the ``(sample_id, window)``
    in ``needed`` (a frame) when given. A crosscoder's: each token's rows of its datasets
    joined on the token and concatenated in its order (a token missing from one is left
    out)."""
    reader = spark.read.format("safetensors")
    if plan.storage_options:
        reader = reader.options(**plan.storage_options)
    from pyspark.sql import functions as F

    keys = ["sample_id", "window", "token_pos"]
    frames = []
    for path in plan.inputs or (plan.dataset,):
        frame = reader.load(path)
        window = "window" if "window" in frame.columns else F.lit(0).alias("window")  # images
        frame = frame.select("activation", "sample_id", window, "token_pos")
        if needed is not None:
            frame = frame.join(F.broadcast(needed), ["sample_id", "window"], "left_semi")
        frames.append(frame)
    if len(frames) == 1:
        return frames[0]
    joined = frames[0].withColumnRenamed("activation", "block0")
    for i, frame in enumerate(frames[1:], 1):
        joined = joined.join(frame.withColumnRenamed("activation", f"block{i}"), keys)
    blocks = [F.col(f"block{i}").cast("array<float>") for i in range(len(frames))]
    return joined.select(F.concat(*blocks).alias("activation"), *keys)


_SAMPLE_ID = re.compile(rb'^\{"sample_id": (-?\d+),')


def read_texts(location: DatasetLocation, sample_ids) -> pa.Table:
    """``sample_id`` and ``text`` of the given samples from ``texts.jsonl``, streamed on
    the driver (only those rows are kept; a line whose id comes first, as the extraction
    writes them, is parsed only when it is wanted)."""
    wanted = {int(i) for i in sample_ids}
    ids, texts = [], []
    with location.fs.open_input_stream(location.path(TEXTS_TABLE, what="file")) as raw:
        for line in io.BufferedReader(raw, 1 << 20):
            m = _SAMPLE_ID.match(line)
            if m is not None and int(m.group(1)) not in wanted:
                continue
            if not line.strip():
                continue
            row = json.loads(line)
            if int(row["sample_id"]) in wanted:
                ids.append(int(row["sample_id"]))
                texts.append(row["text"])
    return pa.table({"sample_id": pa.array(ids, pa.int64()), "text": pa.array(texts, pa.string())})


def merged_state(candidates, plan: FeaturesPlan, config: FeaturesConfig) -> LatentState:
    """The tasks' states merged by Spark (sums, maxima, ``row_number`` windows), as one
    ``LatentState`` on the driver: O(latents x (N + bins x R)) rows cross, no activations."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    stats = to_arrow(
        candidates.filter(F.col("kind").isin(STAT, MAXIMUM, TOKENS, OUT_OF_ORDER))
        .groupBy("kind", "latent", "cell")
        .agg(F.sum("count").alias("count"), F.sum("total").alias("total"), F.max("value"))
    )
    by_value = Window.partitionBy("latent").orderBy(F.desc("value"), F.asc("token"))
    top = candidates.filter(F.col("kind") == TOP)
    if plan.layout is not None:  # distinct images: each one's largest entry (state.distinct)
        sample = F.shiftright("token", POS_BITS + WINDOW_BITS).alias("sample")
        by_image = Window.partitionBy("latent", sample).orderBy(F.desc("value"), F.asc("token"))
        top = top.withColumn("r", F.row_number().over(by_image)).filter(F.col("r") == 1)
    top = to_arrow(
        top.withColumn("r", F.row_number().over(by_value))
        .filter(F.col("r") <= config.top_n)
        .select("latent", "value", "token", "context")
    )
    by_priority = Window.partitionBy("cell").orderBy("priority", "token")
    samples = to_arrow(
        candidates.filter(F.col("kind") == SAMPLE)
        .withColumn("r", F.row_number().over(by_priority))
        .filter(F.col("r") <= config.samples_per_band)
        .select("latent", "cell", "value", "token", "context")
    )
    state = new_state(plan, config)
    kind = stats.column("kind").to_numpy()
    col = {name: stats.column(name).to_numpy() for name in ("latent", "cell", "count", "total")}
    value = stats.column("max(value)").to_numpy()
    stat, maximum = kind == STAT, kind == MAXIMUM
    state.counts[torch.from_numpy(col["cell"][stat])] = torch.from_numpy(col["count"][stat])
    state.sums[torch.from_numpy(col["cell"][stat])] = torch.from_numpy(col["total"][stat])
    state.maxima[torch.from_numpy(col["latent"][maximum].astype(np.int64))] = torch.from_numpy(
        value[maximum].astype(np.float32)
    )
    state.tokens = int(col["count"][kind == TOKENS].sum())
    state.out_of_order = int(col["count"][kind == OUT_OF_ORDER].sum())
    state.top = _entries_of(top, state.window)
    cells = samples.column("cell").to_numpy().astype(np.int64)
    entries = {**_entries_of(samples, state.window), "cell": torch.from_numpy(cells)}
    state.samples = {**entries, "prio": priority(entries["id"], entries["latent"], state.seed)}
    return state


def ground_truth_of(candidates, labels: FactorLabels, plan: FeaturesPlan) -> pa.Table:
    """The ground-truth table (``ground_truth.ground_truth_table``) from the labelled
    patches' codes the tasks kept; every labelled patch must have been met."""
    from pyspark.sql import functions as F

    seen = candidates.filter(F.col("kind") == LABELLED).agg(F.sum("count")).first()[0] or 0
    if seen != len(labels.ids):
        raise FeaturesError(f"factors: {len(labels.ids)} labelled patches, {seen} of them in "
                            f"{plan.dataset} (are its images those of this extraction?)")  # fmt: skip
    codes = to_arrow(candidates.filter(F.col("kind") == CODE).select("token", "latent", "value"))
    values, indices = code_matrix(labels.ids, *(codes.column(c).to_numpy() for c in
                                                ("token", "latent", "value")))  # fmt: skip
    return ground_truth_table(values, indices, labels.masks, plan.n_latents)


def _entries_of(table: pa.Table, window: int) -> dict:
    n = table.num_rows
    ctx = table.column("context").combine_chunks().flatten().to_numpy(zero_copy_only=False)
    return {
        "latent": torch.from_numpy(table.column("latent").to_numpy().astype(np.int64)),
        "value": torch.from_numpy(table.column("value").to_numpy().astype(np.float32)),
        "id": torch.from_numpy(table.column("token").to_numpy().astype(np.int64)),
        "row": torch.full((n,), -1, dtype=torch.int64),
        "ctx": torch.from_numpy(ctx.astype(np.float32).reshape(n, window)),
    }


def windows_from_codes(spark, examples: pa.Table, plan: FeaturesPlan, config: FeaturesConfig):
    """``examples`` with their ``context`` windows recomputed by a second pass: the
    example samples' tokens read through the ``safetensors`` data source and encoded
    again, joined to each example's +-``context`` positions (for a dataset whose rows
    are not in token order, where the first pass could not see the windows)."""
    from pyspark.sql import functions as F

    keys = ["latent", "kind", "rank"]
    ex = from_arrow(spark, examples.drop(["context"]))
    needed = ex.select("sample_id", "window").distinct()
    codes = (
        tokens_frame(spark, plan, needed)
        .mapInArrow(_codes_fn(plan, config), CODES_SCHEMA)
        .withColumnRenamed("token_pos", "pos")
    )
    k = config.context
    span = F.sequence(F.col("token_pos") - k, F.col("token_pos") + k)
    if plan.span:  # an image: every token of it
        span = F.sequence(F.lit(0), F.lit(plan.span - 1))
    positions = ex.select(*keys, "sample_id", "window", F.posexplode(span).alias("o", "pos"))
    act = F.coalesce(
        F.try_element_at(F.map_from_arrays("latents", "acts"), F.col("latent")), F.lit(0.0)
    )
    windows = to_arrow(
        positions.join(codes, ["sample_id", "window", "pos"], "left")
        .groupBy(*keys)
        .agg(F.sort_array(F.collect_list(F.struct("o", act.cast("float").alias("a")))).alias("w"))
        .select(*keys, F.col("w.a").alias("context"))
    )
    order = [(c, "ascending") for c in keys]
    examples, windows = examples.sort_by(order), windows.sort_by(order)
    lengths = pc.list_value_length(windows.column("context")).to_numpy()
    width = plan.span or 2 * k + 1
    if not examples.select(keys).equals(windows.select(keys)) or (lengths != width).any():
        raise FeaturesError(
            f"{plan.dataset}: a token appears twice (sample_id, window, token_pos); "
            "the windows cannot be told apart"
        )
    column = examples.schema.get_field_index("context")
    return examples.set_column(column, "context", windows.column("context").cast(
        examples.schema.field("context").type))  # fmt: skip


def windows_wanted(examples: pa.Table) -> dict[tuple[int, int], list[int]]:
    """The examples' token positions by ``(sample_id, window)``."""
    wanted: dict[tuple[int, int], list[int]] = {}
    columns = (examples.column(c).to_pylist() for c in ("sample_id", "window", "token_pos"))
    for sample, window, pos in zip(*columns, strict=True):
        wanted.setdefault((sample, window), []).append(pos)
    return wanted


def example_tokens(spark, examples: pa.Table, plan: FeaturesPlan, config: FeaturesConfig, *,
                   partitions: int):  # fmt: skip
    """The tokens of the examples' windows (``sample_id, window, pos, token``): the
    example samples' texts tokenized by ``partitions`` Spark tasks (the texts are one
    file, one task else), only those tokens kept."""
    from pyspark.sql import functions as F

    wanted = windows_wanted(examples)
    samples = sorted({sample for sample, _ in wanted})
    source = plan.extraction_location()
    if source.is_local:  # Spark's own reader, in parallel
        texts = (
            spark.read.schema("sample_id long, key string, source string, text string")
            .json(source.path(TEXTS_TABLE, what="file"))
            .join(F.broadcast(from_arrow(spark, pa.table({"sample_id": pa.array(samples, pa.int64())}))),
                  "sample_id", "left_semi")
        )  # fmt: skip
    else:  # Spark's readers cannot reach an object store here: the driver reads them
        texts = from_arrow(spark, read_texts(source, samples))
    texts = texts.repartition(partitions)
    return to_arrow(texts.mapInArrow(tokenize_fn(plan, wanted, config.context), TOKENS_SCHEMA))
