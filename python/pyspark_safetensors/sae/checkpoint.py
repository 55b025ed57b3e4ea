"""SAE checkpoints: the SAE as one safetensors file (the LUT spec's tensor names, config
and metrics as JSON in ``__metadata__``), and trainer state next to it, each directory
written whole under a temporary name and renamed into place, with the sha256 of every
file in ``checksums.json`` (verified when a run resumes from it)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch

from ..dataset.publish import publishing
from ..format import SafetensorsFile, write_shard
from ..format.errors import PysparkSafetensorsError

SAE_FILE = "sae.safetensors"
STATE_FILE = "trainer_state.pt"
CONFIG_FILE = "config.json"
CHECKSUMS_FILE = "checksums.json"
CHECKPOINT_FILES = (SAE_FILE, STATE_FILE, CONFIG_FILE, CHECKSUMS_FILE)
SAE_TENSORS = ("encoder_weight", "encoder_bias", "decoder_weight", "decoder_bias")
CHECKPOINT_VERSION = "1"


class CheckpointError(PysparkSafetensorsError, ValueError):
    """A checkpoint is missing, incomplete or does not fit."""


def required_tensors(metadata: dict) -> dict[str, tuple[int, ...] | None]:
    """The tensors a file of this metadata's architecture must hold, with their shapes
    where the metadata fixes them (a cross-layer transcoder's: ``clt_file_shapes``)."""
    if metadata.get("architecture") == "clt":
        from .architectures.clt import clt_file_shapes

        try:
            return dict(clt_file_shapes(metadata))
        except ValueError as e:
            raise CheckpointError(str(e)) from None
    return dict.fromkeys(SAE_TENSORS)


def save_sae(path: str | os.PathLike, tensors: dict[str, torch.Tensor], metadata: dict) -> None:
    """Write the SAE atomically; ``metadata`` values are JSON-encoded into ``__metadata__``."""
    required = required_tensors(metadata)
    missing = [n for n in required if n not in tensors]
    if missing:
        raise CheckpointError(f"{path}: the SAE lacks tensor(s) {missing}")
    # the shared tensors first, then an architecture's own (e.g. JumpReLU's threshold)
    names = [*required, *sorted(set(tensors) - set(required))]
    arrays = {n: tensors[n].detach().to("cpu", torch.float32).numpy() for n in names}
    meta = {"format": "pyspark-safetensors-sae", "version": CHECKPOINT_VERSION}
    meta.update(
        {k: v if isinstance(v, str) else json.dumps(v, sort_keys=True) for k, v in metadata.items()}
    )
    write_shard(path, arrays, meta)


def load_sae(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict]:
    """The SAE's tensors (float32) and its metadata (``config`` decoded to a dict)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no SAE file")
    with SafetensorsFile(path) as f:
        names = set(f.keys())
        meta = dict(f.metadata or {})
        required = required_tensors(meta)
        missing = [n for n in required if n not in names]
        if missing:
            raise CheckpointError(f"{path}: missing tensor(s) {missing}")
        tensors = {n: torch.from_numpy(np.array(f.tensor(n), dtype=np.float32)) for n in names}
    for key in ("config", "metrics"):
        if key in meta:
            meta[key] = json.loads(meta[key])
    if meta.get("architecture") == "clt":
        for name, shape in required.items():
            if tuple(tensors[name].shape) != shape:
                raise CheckpointError(
                    f"{path}: {name} has shape {tuple(tensors[name].shape)}, expected {shape} "
                    f"(a CLT of {meta['n_layers']} layers, {meta['n_latents']} latents per "
                    f"layer, d_in {meta['d_in']}, d_out {meta['d_out']})"
                )
        return tensors, meta
    n, d_in = tensors["encoder_weight"].shape
    d_out = tensors["decoder_bias"].shape[0] if tensors["decoder_bias"].ndim == 1 else -1
    expected = {"encoder_bias": (n,), "decoder_weight": (n, d_out), "decoder_bias": (d_out,)}
    if "skip_weight" in tensors:  # a skip transcoder's linear path
        expected["skip_weight"] = (d_out, d_in)
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise CheckpointError(
                f"{path}: {name} has shape {tuple(tensors[name].shape)}, expected {shape}"
            )
    return tensors, meta


def file_sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def write_checkpoint(
    directory: str | os.PathLike,
    sae_tensors: dict[str, torch.Tensor],
    trainer_state: dict,
    config: dict,
    metadata: dict,
) -> Path:
    """``directory/{sae.safetensors, trainer_state.pt, config.json, checksums.json}``,
    all or nothing."""
    final = Path(directory)
    with publishing(final) as tmp:
        save_sae(tmp / SAE_FILE, sae_tensors, {"config": config, **metadata})
        torch.save(trainer_state, tmp / STATE_FILE)
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        sums = {n: file_sha256(tmp / n) for n in (SAE_FILE, STATE_FILE, CONFIG_FILE)}
        (tmp / CHECKSUMS_FILE).write_text(json.dumps(sums, indent=2, sort_keys=True) + "\n")
    return final


def is_complete(directory: str | os.PathLike) -> bool:
    """Every file of a checkpoint is there (their contents are verified on loading)."""
    return all(Path(directory, n).is_file() for n in CHECKPOINT_FILES)


def verify_checkpoint(directory: str | os.PathLike) -> None:
    """Refuse a checkpoint with a missing file or one whose bytes changed since it was
    written (a bit flip, a truncated copy)."""
    directory = Path(directory)
    missing = [n for n in CHECKPOINT_FILES if not (directory / n).is_file()]
    if missing:
        raise CheckpointError(f"{directory}: not a complete checkpoint, missing {missing}")
    try:
        sums = json.loads((directory / CHECKSUMS_FILE).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{directory}: {CHECKSUMS_FILE} is not JSON ({e})") from e
    if not isinstance(sums, dict) or set(sums) != {SAE_FILE, STATE_FILE, CONFIG_FILE}:
        raise CheckpointError(
            f"{directory}: {CHECKSUMS_FILE} must map {[SAE_FILE, STATE_FILE, CONFIG_FILE]} "
            "to sha256 digests"
        )
    for name, want in sorted(sums.items()):
        got = file_sha256(directory / name)
        if got != want:
            raise CheckpointError(
                f"{directory}: {name} does not match its recorded sha256 ({got[:12]}... != "
                f"{str(want)[:12]}...): the file was damaged or changed since it was written; "
                "resume from an earlier checkpoint"
            )


def read_checkpoint(directory: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict, dict]:
    """(SAE tensors, trainer state, config dict) of a checkpoint directory, verified
    against its checksums first."""
    directory = Path(directory)
    verify_checkpoint(directory)
    tensors, _ = load_sae(directory / SAE_FILE)
    try:
        state = torch.load(directory / STATE_FILE, map_location="cpu", weights_only=True)
        config = json.loads((directory / CONFIG_FILE).read_text())
    except Exception as e:  # torch raises several types for a damaged pickle
        raise CheckpointError(f"{directory}: unreadable trainer state or config ({e})") from e
    return tensors, state, config


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The newest complete ``checkpoints/step-*`` directory of a run, if any (a newer
    one missing a file, e.g. copied half-way, is passed over)."""
    found = sorted(Path(run_dir, "checkpoints").glob("step-*"), reverse=True)
    return next((p for p in found if p.is_dir() and is_complete(p)), None)
