"""The LUT precompute job: for each target linear layer, ``precomputed_products = W_dec @
W_target`` and ``bias_product = b_dec @ W_target`` from the layer's SAE and the layer's
weight alone (read with ``safe_open(...).get_slice``; the model is never loaded whole).

A transcoder of a whole MLP block (keyed by the block, ``model.layers.N.mlp``) needs no
product: its decoder rows already are the block's output per latent, so its file holds the
transcoder's own tensors in the spec's names (``spec.MLP_TENSORS``, ``kind: "mlp"``).

Layers are independent: under ``torch.distributed`` each rank takes every world-th layer;
on one process they run one after the other, each matmul using every core. Memory stays
bounded by one layer. Files go to a staging directory and ``lut/`` appears (with
``metadata.json`` written last) only when every layer is done.
"""

from __future__ import annotations

import difflib
import json
import os
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from ..dataset.publish import publish
from ..format import SafetensorsFile, write_shard
from ..format.dtypes import canonical_dtype
from ..sae.architectures import get_architecture
from ..sae.checkpoint import CheckpointError
from ..sae.ecosystem import load_sae_model, read_sae
from ..torch.dtypes import TORCH_DTYPES, to_numpy
from .spec import (
    LINEAR,
    METADATA,
    MLP,
    VERSION,
    LUTError,
    check_blocks,
    layer_file,
    validate_lut,
)

CONV1D_MODEL_TYPES = frozenset({"gpt2", "openai-gpt", "imagegpt", "decision_transformer"})
"""``model_type``s whose projections are ``transformers``' Conv1D: weights stored ``[in,
out]``, the transpose of a Linear's."""
STORE_DTYPES = {name: TORCH_DTYPES[name] for name in ("F16", "BF16")}
"""Storage dtypes of LUT files, by canonical name (any alias: float16, fp16, bfloat16...)."""
TRANSCODERS = ("transcoder", "skip_transcoder")
"""Architectures whose code reconstructs an MLP block's output from its input: they make
MLP-block LUTs, keyed by the block's name."""
SHORTEST_SECONDS = 1e-9
"""A duration too short to measure counts as this, so FLOP/s stays finite."""


class ModelWeights:
    """The linear weights of a Hugging Face model directory (``model.safetensors`` or
    sharded ``model-0000x-of-0000y.safetensors`` with ``model.safetensors.index.json``),
    read one tensor at a time."""

    def __init__(self, model_dir: str | os.PathLike):
        self.dir = Path(model_dir)
        index = self.dir / "model.safetensors.index.json"
        single = self.dir / "model.safetensors"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.file_of = {k: self.dir / v for k, v in weight_map.items()}
        elif single.is_file():
            with SafetensorsFile(single) as f:
                self.file_of = dict.fromkeys(f.keys(), single)
        else:
            raise LUTError(
                f"{self.dir}: no model.safetensors or model.safetensors.index.json "
                "(a Hugging Face model directory is expected)"
            )
        for path in set(self.file_of.values()):
            if not path.is_file() or path.resolve().parent != self.dir.resolve():
                raise LUTError(
                    f"{self.dir}: weight file {path.name} is missing or outside the directory"
                )
        self._shapes: dict[str, tuple[int, ...]] = {}
        # GPT-2 style models keep their projections in Conv1D modules, weights [in, out]
        self.transposed = self.config().get("model_type") in CONV1D_MODEL_TYPES

    def shape(self, key: str) -> tuple[int, ...]:
        if key not in self._shapes:
            with SafetensorsFile(self.file_of[key]) as f:
                for info in f.header.tensors:
                    self._shapes[info.name] = tuple(info.shape)
        return self._shapes[key]

    def linear_layers(self) -> list[str]:
        """Names of every 2-d ``*.weight`` tensor, without the ``.weight``."""
        return sorted(
            k[: -len(".weight")]
            for k in self.file_of
            if k.endswith(".weight") and len(self.shape(k)) == 2
        )

    def resolve(self, layer: str) -> str:
        """The weight key of ``layer`` (exact, or the one key that ends with it, so that
        ``encoder.layer.0...`` finds ``bert.encoder.layer.0...``)."""
        if f"{layer}.weight" in self.file_of:
            return f"{layer}.weight"
        found = [k for k in self.file_of if k.endswith(f".{layer}.weight")]
        if len(found) == 1:
            return found[0]
        linear = self.linear_layers()
        close = difflib.get_close_matches(layer, linear, n=5, cutoff=0.5)
        raise LUTError(
            f"layer {layer!r} is not a linear layer of {self.dir}"
            + (f"; did you mean {close}?" if close else f"; it has {linear[:8]}...")
            + (f" (ambiguous: {found})" if found else "")
        )

    def dims(self, layer: str) -> tuple[int, int]:
        """(input_dim, output_dim) of a torch Linear weight ``[out, in]`` (a Conv1D
        weight ``[in, out]`` in the models of ``CONV1D_MODEL_TYPES``)."""
        shape = self.shape(self.resolve(layer))
        if len(shape) != 2:
            raise LUTError(f"{layer}: weight has shape {list(shape)}, not a linear layer")
        return (shape[0], shape[1]) if self.transposed else (shape[1], shape[0])

    def weight(self, layer: str) -> torch.Tensor:
        """The ``[out, in]`` weight of one layer, read alone (a Conv1D weight transposed)."""
        from safetensors import safe_open

        key = self.resolve(layer)
        with safe_open(self.file_of[key], framework="pt") as f:
            weight = f.get_slice(key)[:]
        return weight.t().contiguous() if self.transposed else weight

    def block(self, name: str) -> str:
        """The weight-key prefix of the module ``name`` that holds other modules' weights
        (an MLP block, ``model.layers.0.mlp``): ``name`` itself, or the one prefix that ends
        with it (``transformer.`` + ``h.0.mlp``)."""
        if any(k.startswith(name + ".") for k in self.file_of):
            return name
        found = {k[: k.index(f".{name}.") + len(name) + 1] for k in self.file_of
                 if f".{name}." in k}  # fmt: skip
        if len(found) != 1:
            raise LUTError(
                f"{name!r} is not a block of {self.dir}: "
                + (f"ambiguous, {sorted(found)}" if found else "no weight lies under it")
            )
        return found.pop()

    def config(self) -> dict:
        path = self.dir / "config.json"
        return json.loads(path.read_text()) if path.is_file() else {}


@dataclass(frozen=True)
class SAEInfo:
    path: Path
    num_basis: int
    input_dim: int
    k: int | None
    architecture: str = "topk"
    output_dim: int = 0
    """A transcoder's output width (its decoder's); an SAE's is its input width."""

    @property
    def transcoder(self) -> bool:
        return self.architecture in TRANSCODERS


def _sae_info(path: str | os.PathLike) -> tuple[SAEInfo, dict[str, torch.Tensor]]:
    """The SAE's (or transcoder's) shape and ``k`` and its tensors in the trainer's
    convention, from any layout ``read_sae`` knows (ours, SAELens, sparsify); an
    architecture whose code the LUT's per-row top-k cannot reproduce (``LUT_REFUSAL``:
    JumpReLU) is refused."""
    path = Path(path)
    if not path.exists():
        raise LUTError(f"SAE checkpoint {path} does not exist")
    try:
        tensors, info = read_sae(path)
    except CheckpointError as e:
        raise LUTError(f"{path}: not a usable SAE ({e})") from e
    arch = info["architecture"]
    refusal = "" if arch in TRANSCODERS else get_architecture(arch).LUT_REFUSAL
    if refusal:
        raise LUTError(f"{path}: {refusal}")
    n, d_out = tensors["decoder_weight"].shape
    d_in = tensors["encoder_weight"].shape[1]
    return SAEInfo(path, n, d_in, info["k"], arch, d_out), tensors


def folded_encoder_bias(sae: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``b_enc - W_enc b_dec`` in float64 then float32: the bias under which the LUT's
    ``ReLU(x W_enc^T + b)`` equals the trainer's ``ReLU(W_enc (x - b_dec) + b_enc)``."""
    w_enc = sae["encoder_weight"].to(torch.float64)
    folded = sae["encoder_bias"].to(torch.float64) - w_enc @ sae["decoder_bias"].to(torch.float64)
    return folded.to(torch.float32)


def precompute_layer(
    weight: torch.Tensor,
    sae: Mapping[str, torch.Tensor],
    *,
    store_dtype: torch.dtype = torch.float16,
    compute_dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """The six tensors of one layer file. ``weight`` is the torch Linear weight
    ``[output_dim, input_dim]``; ``W_target = weight.T``.

    ``sae`` is in the trainer's convention, ``ReLU(W_enc (x - b_dec) + b_enc)``; the LUT
    encodes ``ReLU(x W_enc^T + b_enc')``, so ``b_enc' = b_enc - W_enc b_dec`` is folded here
    in float32 (at least) before the cast: both then select the same latents."""
    w_target = weight.to(device, compute_dtype).t()
    w_dec = sae["decoder_weight"].to(device, compute_dtype)
    b_dec = sae["decoder_bias"].to(device, compute_dtype)
    out = {
        "encoder_weight": sae["encoder_weight"],
        "encoder_bias": folded_encoder_bias(sae),
        "decoder_weight": sae["decoder_weight"],
        "decoder_bias": sae["decoder_bias"],
        "precomputed_products": w_dec @ w_target,
        "bias_product": b_dec @ w_target,
    }
    return {k: v.to("cpu", store_dtype).contiguous() for k, v in out.items()}


def precompute_mlp(
    transcoder: Mapping[str, torch.Tensor], *, store_dtype: torch.dtype = torch.float16
) -> dict[str, torch.Tensor]:
    """The tensors of an MLP block's file (``spec.MLP_TENSORS``) from a transcoder in the
    checkpoint's names: its encoder as it is (a transcoder's encoder reads ``x`` without
    any decoder-bias centring, which is the LUT's ``x @ encoder_weight.T + encoder_bias``
    already), ``precomputed_products`` = its decoder rows (the block's output per latent),
    ``bias_product`` = its decoder bias, and ``skip_weight`` when it has one."""
    names = {"encoder_weight": "encoder_weight", "encoder_bias": "encoder_bias",
             "precomputed_products": "decoder_weight", "bias_product": "decoder_bias"}  # fmt: skip
    if "skip_weight" in transcoder:
        names["skip_weight"] = "skip_weight"
    return {ours: transcoder[theirs].to("cpu", store_dtype).contiguous()
            for ours, theirs in names.items()}  # fmt: skip


def precompute_clt(
    model_dir: str | os.PathLike,
    clt_path: str | os.PathLike,
    *,
    out_dir: str | os.PathLike | None = None,
    dtype: str = "float16",
    overwrite: bool = False,
    source_model: str | None = None,
) -> dict:
    """The whole-model LUT of a cross-layer transcoder (our CLT file): one MLP block file
    per block the CLT covers (``model.layers.N.mlp``), holding that layer's encoder, the
    rows of ``W_dec^{l->N}`` of every source ``l <= N`` stacked in source order as
    ``precomputed_products``, ``b_dec^N`` as ``bias_product``, and the sources' block
    names in ``sources`` (``spec``'s module docstring). ``k_active`` is the CLT's ``k``
    (per layer), ``num_basis`` its latents per layer. Returns the metadata."""
    store = STORE_DTYPES[_store_dtype(dtype)]
    model = ModelWeights(model_dir)
    out_dir = Path(out_dir) if out_dir is not None else model.dir / "lut"
    if out_dir.exists() and not overwrite:
        raise LUTError(f"{out_dir} already exists; pass overwrite=True to replace it")
    clt = load_sae_model(clt_path)
    blocks = [h.rpartition(":")[0] for h in getattr(clt, "hook_points", ())]
    if getattr(clt, "ARCHITECTURE", "") != "clt" or len(blocks) != clt.n_layers:
        raise LUTError(f"{clt_path}: not a cross-layer transcoder that names its blocks")
    hidden = model_config(model.config()).get("hidden_size")
    for block in blocks:
        model.block(block)
        if hidden is not None and (clt.d, clt.d_out) != (hidden, hidden):
            raise LUTError(
                f"{clt_path}: widths {clt.d}->{clt.d_out}; {block!r} reads and writes {hidden}"
            )
    layers = {}
    staging = out_dir.with_name(f".{out_dir.name}.staging")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        _write_clt_files(staging, clt, blocks, store, layers)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    plan = _LUTPlan(layers, {}, clt.n_latents, clt.k)
    meta = _metadata(model, plan, source_model)
    meta["creation_info"]["sae_model"] = Path(clt_path).name
    (staging / METADATA).write_text(json.dumps(meta, indent=2) + "\n")
    validate_lut(staging)
    publish(staging, out_dir)
    return meta


@torch.no_grad()
def _write_clt_files(
    staging: Path, clt, blocks: list[str], store: torch.dtype, layers: dict
) -> None:
    """Each block's file of ``precompute_clt`` into ``staging``, its entry into ``layers``."""
    for t, block in enumerate(blocks):
        sources = blocks[: t + 1]
        tensors = {
            "encoder_weight": clt.encoder_weight[t], "encoder_bias": clt.encoder_bias[t],
            "precomputed_products": torch.cat([clt.decoder(s, t) for s in range(t + 1)]),
            "bias_product": clt.decoder_bias[t],
        }  # fmt: skip
        header = {"format": "lut", "version": VERSION, "layer": block, "kind": MLP,
                  "sources": json.dumps(sources)}  # fmt: skip
        write_shard(staging / layer_file(block),
                    {n: to_numpy(v.to("cpu", store).contiguous()) for n, v in tensors.items()},
                    header)  # fmt: skip
        layers[block] = {"input_dim": clt.d, "output_dim": clt.d_out, "file": layer_file(block),
                         "kind": MLP, "skip": False, "sources": sources}  # fmt: skip


def _rank_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def precompute_lut(
    model_dir: str | os.PathLike,
    saes: Mapping[str, str | os.PathLike],
    *,
    out_dir: str | os.PathLike | None = None,
    dtype: str = "float16",
    k_active: int | None = None,
    compute_dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    overwrite: bool = False,
    progress: bool = True,
    source_model: str | None = None,
) -> dict:
    """Build ``lut/`` (default ``model_dir/lut``) for the layers in ``saes``
    (``{layer name: SAE checkpoint path}``; one SAE may serve several layers that share
    an input, e.g. query, key and value). ``k_active`` defaults to the SAEs' ``k``.
    A transcoder (or skip transcoder) keyed by an MLP block's name
    (``"model.layers.0.mlp"``) makes that block's LUT (``precompute_mlp``).

        precompute_lut("all-MiniLM-L6-v2", {
            "encoder.layer.0.attention.self.query": "runs/sae-l0-q/sae.safetensors",
            "encoder.layer.0.attention.self.key": "runs/sae-l0-q/sae.safetensors",
        })

    Everything is checked before any matmul: layer names (close matches suggested),
    SAE widths against layer inputs (a transcoder's against the model's hidden size), one
    ``num_basis`` for all SAEs, no linear layer inside an MLP block of the same LUT. Returns the
    metadata plus a ``timing`` entry (seconds, FLOP/s)."""
    dtype = _store_dtype(dtype)
    if not saes:
        raise LUTError("no layers given")
    model = ModelWeights(model_dir)
    out_dir = Path(out_dir) if out_dir is not None else model.dir / "lut"
    if out_dir.exists() and not overwrite:
        raise LUTError(f"{out_dir} already exists; pass overwrite=True to replace it")
    plan = _plan(model, saes, k_active)

    rank, world = _rank_world()
    staging = out_dir.with_name(f".{out_dir.name}.staging")  # one name: every rank writes here
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    _barrier()
    started = time.perf_counter()
    flops = _write_layer_files(
        staging, model, plan, list(plan.layers)[rank::world],
        store_dtype=STORE_DTYPES[dtype], compute_dtype=compute_dtype, device=device,
        progress=progress and rank == 0,
    )  # fmt: skip
    seconds = time.perf_counter() - started
    _barrier()
    meta = _metadata(model, plan, source_model)
    if rank == 0:
        (staging / METADATA).write_text(json.dumps(meta, indent=2) + "\n")
        validate_lut(staging)
        publish(staging, out_dir)
    _barrier()
    return {
        **meta,
        "timing": {"seconds": seconds, "flops_per_s": flops / max(seconds, SHORTEST_SECONDS)},
    }


def _store_dtype(dtype: str) -> str:
    """The canonical name of a LUT storage dtype (F16 or BF16, named any usual way)."""
    try:
        dtype = canonical_dtype(dtype)
    except ValueError as e:
        raise LUTError(f"LUT dtype: {e}") from None
    if dtype not in STORE_DTYPES:
        raise LUTError(f"LUT dtype must be F16 or BF16 (float16, bfloat16), got {dtype}")
    return dtype


@dataclass(frozen=True)
class _LUTPlan:
    """What a LUT will hold, checked before any matmul."""

    layers: dict[str, dict]
    """metadata.json's ``layers``: ``{layer: {input_dim, output_dim, file}}``."""
    saes: dict[str, tuple[SAEInfo, dict[str, torch.Tensor]]]
    """Each layer's SAE (one read per checkpoint, however many layers share it)."""
    num_basis: int
    k_active: int


def _plan(model: ModelWeights, saes: Mapping[str, str | os.PathLike], k_active: int | None):
    """Read every SAE once and check it against its layer and the others."""
    files = {layer: layer_file(layer) for layer in saes}
    loaded = {path: _sae_info(path) for path in dict.fromkeys(map(str, saes.values()))}
    by_layer = {layer: loaded[str(path)] for layer, path in saes.items()}
    layers = {}
    for layer, (info, _) in by_layer.items():
        if info.transcoder:
            layers[layer] = {**_mlp_dims(model, layer, info), "file": files[layer],
                             "kind": MLP, "skip": info.architecture == "skip_transcoder"}  # fmt: skip
            continue
        input_dim, output_dim = model.dims(layer)
        if info.input_dim != input_dim:
            raise LUTError(
                f"SAE {info.path} has input dim {info.input_dim}, layer {layer!r} takes {input_dim}"
            )
        layers[layer] = {"input_dim": input_dim, "output_dim": output_dim, "file": files[layer]}
    check_blocks({layer: entry.get("kind", LINEAR) for layer, entry in layers.items()})
    infos = [info for info, _ in by_layer.values()]
    bases = {i.num_basis for i in infos}
    if len(bases) != 1:
        raise LUTError(f"the SAEs disagree on num_basis {sorted(bases)}; metadata has one")
    (num_basis,) = bases
    ks = {i.k for i in infos if i.k is not None}
    k = k_active or (ks.pop() if len(ks) == 1 else None)
    if k is None:
        raise LUTError(f"pass k_active: the SAEs record k values {sorted(ks) or 'none'}")
    if not 0 < k <= num_basis:
        raise LUTError(f"k_active {k} outside 1..num_basis {num_basis}")
    return _LUTPlan(layers, by_layer, num_basis, k)


def _mlp_dims(model: ModelWeights, block: str, info: SAEInfo) -> dict[str, int]:
    """A transcoder's entry dims, checked against the model: ``block`` must be a block of
    weights, not one linear layer, and an MLP block reads and writes the hidden size."""
    if any(k == f"{block}.weight" or k.endswith(f".{block}.weight") for k in model.file_of):
        raise LUTError(
            f"{info.path} is a {info.architecture}, which replaces a whole MLP block; key it by "
            f"the block (e.g. {block.rsplit('.', 1)[0]!r}), not by the linear layer {block!r}"
        )
    model.block(block)
    hidden = model_config(model.config()).get("hidden_size")
    for what, dim in (("input", info.input_dim), ("output", info.output_dim)):
        if hidden is not None and dim != hidden:
            raise LUTError(
                f"transcoder {info.path} has {what} dim {dim}; block {block!r} of {model.dir} "
                f"reads and writes the hidden size {hidden}"
            )
    return {"input_dim": info.input_dim, "output_dim": info.output_dim}


def _write_layer_files(
    staging: Path,
    model: ModelWeights,
    plan: _LUTPlan,
    layers: list[str],
    *,
    store_dtype: torch.dtype,
    compute_dtype: torch.dtype,
    device: str,
    progress: bool,
) -> int:
    """One ``.lut.safetensors`` file per layer of ``layers`` into ``staging`` (deleted on
    failure); returns the FLOPs spent."""
    flops = 0
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(layers), desc="LUT layers", unit="layer")
    try:
        for layer in layers:
            entry = plan.layers[layer]
            header = {"format": "lut", "version": VERSION, "layer": layer}
            if entry.get("kind") == MLP:  # a transcoder: its tensors, no product to compute
                tensors = precompute_mlp(plan.saes[layer][1], store_dtype=store_dtype)
                header["kind"] = MLP
            else:
                tensors = precompute_layer(
                    model.weight(layer),
                    plan.saes[layer][1],
                    store_dtype=store_dtype,
                    compute_dtype=compute_dtype,
                    device=device,
                )
                flops += 2 * (plan.num_basis + 1) * entry["input_dim"] * entry["output_dim"]
            write_shard(
                staging / entry["file"],
                {n: to_numpy(t) for n, t in tensors.items()},
                header,
            )
            if bar is not None:
                bar.update(1)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        if bar is not None:
            bar.close()
    return flops


_MODEL_CONFIG_KEYS = (
    ("model_type", ("model_type",)),
    ("num_layers", ("num_hidden_layers", "n_layer", "num_layers")),
    ("num_attention_heads", ("num_attention_heads", "n_head")),
    ("hidden_size", ("hidden_size", "n_embd", "d_model")),
)
"""(metadata.json's ``model_config`` key, the Hugging Face config keys it may come from, in
order: Llama and BERT name them as the spec does, GPT-2 ``n_layer``/``n_head``/``n_embd``)."""


def model_config(config: dict) -> dict:
    """metadata.json's ``model_config`` from a Hugging Face ``config.json``; a model whose
    language model sits in ``text_config`` (Gemma 3, Llava...) is read there."""
    text = config.get("text_config")
    inner = {**text, "model_type": config.get("model_type")} if isinstance(text, dict) else {}
    out = {}
    for key, sources in _MODEL_CONFIG_KEYS:
        for doc in (config, inner):
            found = next((doc[s] for s in sources if s in doc), None)
            if found is not None:
                out[key] = found
                break
    return out


def _metadata(model: ModelWeights, plan: _LUTPlan, source_model: str | None) -> dict:
    """metadata.json (the LUT specification's fields)."""
    config = model.config()
    return {
        "version": VERSION,
        "sae_config": {"num_basis": plan.num_basis, "k_active": plan.k_active},
        "model_config": model_config(config),
        "layers": plan.layers,
        "creation_info": {
            "created_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "source_model": source_model or config.get("_name_or_path") or model.dir.name,
            "sae_model": ", ".join(sorted({info.path.name for info, _ in plan.saes.values()})),
        },
    }
