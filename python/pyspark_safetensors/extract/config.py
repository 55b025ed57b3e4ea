"""What an extraction is asked to do (``ExtractConfig``, a frozen dataclass: the CLI's
``extract`` options are generated from it) and what it reports (``ExtractionSummary``),
with the config hash that names the activations it produces."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from .model import ExtractionError, parse_layers

SHORTEST_SECONDS = 1e-9
"""A duration too short to measure counts as this, so rates stay finite."""
DEFAULT_HOOKS = (
    "encoder.layer.0.attention.self.query:input",
    "encoder.layer.0.intermediate.dense:input",
)

IMAGE_FIELDS = ("images", "image_column", "label_column", "id_column", "bad_images")
"""The fields of an image corpus (left out of a text extraction's hash)."""


@dataclass(frozen=True)
class ExtractConfig:
    corpus: str = "demo"
    """"demo" (Python's pydoc_data.topics in passages), a directory of text files, or a
    parquet/JSON table path with a ``text`` column (``text_column``). A DataFrame corpus
    is passed to ``run_extraction`` instead."""
    text_column: str = "text"
    model: str = ""
    """A Hugging Face model id (``org/name[@revision]``, found in the local Hugging Face
    cache, ``HF_HUB_CACHE``; fetched only when missing there and ``HF_HUB_OFFLINE`` is
    not set) or a local model directory; empty = the packaged all-MiniLM-L6-v2."""
    model_dir: str = ""
    """The former name of ``model`` (a local directory or a model id); set one of them."""
    hooks: tuple[str, ...] = DEFAULT_HOOKS
    """Module globs with ":input" (the input of e.g. a linear layer) or ":output". An
    image corpus left with this default takes every transformer block's output."""
    mlp_layers: str = ""
    """Also every named block's MLP input and output, found in the model whatever its
    family calls them (``model.layers.{i}.mlp``, ``transformer.h.{i}.mlp``, BERT's
    ``intermediate`` ... ``output.dense``; ``model.MLP_MODULES``): "all", a layer "3", a
    range "0-11" (inclusive) or a comma list "0-3,8"; empty = none. ``hooks`` left at
    their default are dropped (only the MLPs are extracted). Their datasets are row-aligned
    with every other hook point's, as always: the cross-layer transcoder's training data."""
    max_length: int = 128
    """Tokens per model input, special tokens included; 0 = the model's context (the
    job records the number it resolved)."""
    long_texts: str = "window"
    """Texts over ``max_length`` tokens: "window" (consecutive windows) or "truncate"."""
    keep_bos: bool = False
    """Keep the BOS token's activations where the tokenizer adds one (Llama's does, GPT-2's
    and BERT's do not); dropped by default, as SAE training data usually drops them: BOS
    activations are outliers, the same in every input. ``token_pos`` stays the position in
    the model input either way."""
    batch_size: int = 32
    dtype: str = "F16"
    rows_per_shard: int = 16384
    """Tokens per shard of the token-level datasets."""
    partitions: int = 0
    """Spark partitions of the corpus; 0 = the session's default parallelism."""
    passage_chars: int = 400
    """Passage size of the demo corpus."""
    max_texts: int = 0
    """Use only the first N texts (or images) by key; 0 = all."""
    kv_dataset: bool = True
    partition_by_hook: bool = False
    """Write the token-level activations as one dataset partitioned by hook point
    (``activations/hook=<name>/``, each directory the dataset ``activations/<hook>/`` would
    be) instead of one dataset per hook point; needs the JVM source (the shim jar)."""
    zarr_run: bool = False
    """Also write the samples as a Zarr sharded run (``samples_zarr/``: each Spark task
    one writer of ``shards/shard-XXXX.zarr``, layers = hook points in order, T_max =
    ``max_length``); needs the ``interop`` extra (zarr) and hook points of one width."""
    images: str = ""
    """An image corpus instead of texts (a vision model then): a directory, object-store
    prefix or glob of image files (Spark's ``binaryFile`` source, recursive), or a
    parquet table path with an image-bytes column (``image_column``). A DataFrame of
    images is passed to ``run_extraction(images=...)`` instead. Every token of every
    image is kept; ``max_length`` is recorded as the tokens per image."""
    image_column: str = "image"
    """The image column of a table or DataFrame of images: encoded bytes (PNG, JPEG,
    ...) or the struct of Spark's ``image`` source."""
    label_column: str = ""
    """A label column of a table or DataFrame of images (``images.parquet``'s
    ``label``); files under a directory are labelled by their folder below it (the
    ImageFolder layout), files at its top level have none."""
    id_column: str = ""
    """An id column of a table or DataFrame of images: the images' order and keys;
    empty = their paths (relative to a directory or glob corpus's root)."""
    bad_images: str = "skip"
    """Unreadable or truncated images: "skip" (listed in ``extraction.json`` with a
    warning) or "fail" (the job stops with an error naming the first one's path)."""
    saev_dump: bool = False
    """Also write the activations of an image corpus as a saev protocol v1 dump
    (``saev/<HASH>/``: every hook point one layer, each shard written by the Spark task
    that owns its images); needs hook points of one width, one per transformer block."""
    max_patches_per_shard: int = 2_400_000
    """The saev dump's shard budget in activation vectors (protocol §3): a shard holds
    ``max_patches_per_shard // (layers x tokens per image)`` images."""

    def __post_init__(self):
        if self.model_dir:  # one home for the model: fold the former name into ``model``
            if self.model and self.model != self.model_dir:
                raise ExtractionError(
                    f"model {self.model!r} and model_dir {self.model_dir!r} disagree; set model only"
                )
            object.__setattr__(self, "model", self.model_dir)
            object.__setattr__(self, "model_dir", "")
        if self.bad_images not in ("skip", "fail"):
            raise ExtractionError(f"bad_images must be 'skip' or 'fail', got {self.bad_images!r}")
        if self.mlp_layers:
            parse_layers(self.mlp_layers)  # the syntax now; the model's layers at planning
            if tuple(self.hooks) == DEFAULT_HOOKS:
                object.__setattr__(self, "hooks", ())
        if self.images and self.corpus != "demo":
            raise ExtractionError(
                f"corpus {self.corpus!r} and images {self.images!r}: give one of them"
            )

    @property
    def modality(self) -> str:
        """ "image" for an image corpus, else "text"."""
        return "image" if self.images else "text"

    def to_dict(self) -> dict:
        body = {**dataclasses.asdict(self), "hooks": list(self.hooks)}
        body.pop("model_dir")  # always folded into model
        return body


@dataclass
class ExtractionSummary:
    out_dir: Path | str
    """The output: a local directory, or the URI it was written to."""
    texts: int
    samples: int
    tokens: int
    bytes: int
    seconds: float
    config_hash: str
    hooks: dict[str, int] = field(default_factory=dict)
    modality: str = "text"
    """"text" or "image" (then ``texts`` counts the images extracted)."""
    bad_images: list[str] = field(default_factory=list)
    """The paths of the unreadable images skipped (an image corpus)."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, SHORTEST_SECONDS)

    def __str__(self) -> str:
        if self.modality == "image":
            skipped = f" ({len(self.bad_images)} unreadable skipped)" if self.bad_images else ""
            return (
                f"{self.texts:,} images{skipped} -> {self.tokens:,} tokens, "
                f"{len(self.hooks)} hook point(s), {self.bytes / 1e9:.3f} GB in "
                f"{self.seconds:.1f} s ({self.texts / max(self.seconds, SHORTEST_SECONDS):,.1f} "
                "images/s)"
            )
        return (
            f"{self.texts:,} texts -> {self.samples:,} model inputs, {self.tokens:,} tokens, "
            f"{len(self.hooks)} hook point(s), {self.bytes / 1e9:.3f} GB in {self.seconds:.1f} s "
            f"({self.tokens_per_s:,.0f} tokens/s)"
        )


def config_hash(config: ExtractConfig, model_hash: str, corpus_hash: str = "") -> str:
    """sha256 of the canonical JSON of everything that determines the activations;
    ``corpus_hash`` (``corpus.corpus_sha256``) names the texts of a DataFrame corpus."""
    body = {**config.to_dict(), "model_weights_sha256": model_hash}
    if corpus_hash:
        body["corpus_sha256"] = corpus_hash
    body.pop("partitions")  # the layout of the work does not change the data
    body.pop("zarr_run")  # nor does a second copy of the samples
    if not body["images"]:  # a text extraction hashes as it did before images existed
        for name in IMAGE_FIELDS:
            body.pop(name)
    body.pop("saev_dump")  # nor a saev copy of them, nor its shard size
    body.pop("max_patches_per_shard")
    if not body["partition_by_hook"]:  # the default layout hashes as it always has
        body.pop("partition_by_hook")
    if not body["mlp_layers"]:  # so does an extraction of named hook points only
        body.pop("mlp_layers")
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()
