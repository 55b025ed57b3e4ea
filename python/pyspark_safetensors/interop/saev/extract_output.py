"""The extraction's saev output: the activations of an image corpus written as a saev
protocol v1 dump, ``saev/<HASH>/``, by the model stage's own tasks as they compute.

Layers are the hook points in order (``layers`` = each one's transformer block index);
the token axis is the CLS token (when the model has one) and then the image patches in
the model's scan order. Register tokens are not written: protocol v1's token axis is
``[CLS] + n_patches_per_img`` image patches and has no place for them (they stay in the
token-level datasets, ``token_kind`` "register"). Image ``i`` of the dump is
``image_id`` ``i`` (the extraction numbers the readable images ``0 .. n - 1``): shard
``i // S``, slot ``i % S``, with ``S = n_imgs_per_shard`` (protocol §3). The job cuts
the images into Spark partitions at multiples of ``S`` (``images_per_partition_multiple``),
so each shard file is written by the one task that owns its images: under a
task-attempt name, moved into the dump's staging directory whole when the task ends. The driver checks that every image landed once, writes
``metadata.json`` last and renames the staging directory to the hash: the dump appears
whole or not at all. Shards are padded with zeros to the full shard shape, as saev's
writer (and ours, ``DumpWriter``) leaves them, so the dump is byte for byte what
``write_dump`` makes of the same activations.

numpy and pyarrow only: the tasks need neither pyspark nor torch here.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import pyarrow as pa

from ...dataset.publish import publish, staging_path
from ...format import get_dtype
from .dump import check_shards, metadata_text, write_metadata
from .protocol import (
    MAX_PATCHES_PER_SHARD,
    VIT_FAMILIES,
    DumpError,
    Metadata,
    imgs_per_shard,
    new_metadata,
    shard_file,
)

SAEV_DIR = "saev"
"""The dump's ``dump_to`` directory in the extraction's output."""

FAMILY_OF_MODEL_TYPE = {
    "clip": "clip",
    "clip_vision_model": "clip",
    "siglip": "siglip",
    "siglip_vision_model": "siglip",
    "dinov2": "dinov2",
    "dinov2_with_registers": "dinov2",
    # a plain ViT: protocol v1 knows three families; saev reads the family only to load
    # ``vit_ckpt`` again with its own loaders (none loads a local Hugging Face ViT), and
    # DINOv2's token layout is the plain ViT's: CLS, then patches row-major
    "vit": "dinov2",
}
"""``vit_family`` by the Hugging Face ``model_type`` of the model."""

_BLOCK = re.compile(r"(?:^|\.)(?:layer|layers|h|blocks|block)\.(\d+)(?:\.|$)")
"""The rule of the datasets' ``layer`` column (``extract.vision.hook_layer``)."""


def block_index(hook: str) -> int | None:
    """The transformer block a hook point is in (``vit.encoder.layer.3.output:output``
    -> 3), or None (embeddings, the final norm)."""
    found = _BLOCK.search(hook.rpartition(":")[0] or hook)
    return int(found.group(1)) if found else None


def layers_refusal(hooks: list[str]) -> str | None:
    """Why these hook points cannot be a dump's ``layers``, or None."""
    blocks = [block_index(h) for h in hooks]
    loose = [h for h, b in zip(hooks, blocks, strict=True) if b is None]
    if loose:
        return (
            f"saev_dump records each hook point as its transformer block's index (the "
            f"protocol's 'layers'); {loose} are in no numbered block: hook the blocks' modules "
            "(e.g. 'encoder.layer.*:output', the residual stream after each block)"
        )
    shared = sorted({b for b in blocks if blocks.count(b) > 1})
    if shared:
        return (
            f"saev_dump records one hook point per transformer block (the protocol's 'layers' "
            f"are block indices); several hook points are in block(s) {shared}: {hooks}"
        )
    return None


@dataclass(frozen=True)
class SaevPlan:
    """What every task and the driver agree on before the model stage: the hook columns
    and their layers, the tokens of a sample row and those the dump keeps, the shard size
    and the ``metadata.json`` keys that do not depend on the number of images."""

    columns: tuple[str, ...]
    """The sample rows' Tensor Struct column of each hook point, in layer order."""
    layers: tuple[int, ...]
    d_vit: int
    dtype: str
    """The sample rows' activation dtype (widened exactly to float32)."""
    cls_token: bool
    n_registers: int
    n_patches_per_img: int
    max_patches_per_shard: int
    vit_family: str
    vit_ckpt: str
    data: dict
    seed: int = 0
    """The extraction has no randomness; saev's key records 0."""

    def __post_init__(self):
        if self.vit_family not in VIT_FAMILIES:
            raise DumpError(f"vit_family {self.vit_family!r}: protocol v1 knows {VIT_FAMILIES}")
        if self.n_imgs_per_shard < 1:
            raise DumpError(
                f"max_patches_per_shard={self.max_patches_per_shard} holds no whole image of "
                f"{len(self.layers)} layer(s) x {self.n_tokens_per_img} tokens; raise it to at "
                f"least {len(self.layers) * self.n_tokens_per_img}"
            )

    @property
    def seq_len(self) -> int:
        """Tokens of a sample row: CLS, registers, patches."""
        return int(self.cls_token) + self.n_registers + self.n_patches_per_img

    @property
    def n_tokens_per_img(self) -> int:
        """T: the tokens the dump keeps (CLS and patches)."""
        return int(self.cls_token) + self.n_patches_per_img

    @property
    def tokens(self) -> slice | np.ndarray:
        """The positions in a sample row of the dump's tokens."""
        if not self.n_registers:
            return slice(None)
        patches = np.arange(self.seq_len - self.n_patches_per_img, self.seq_len)
        return np.concatenate([[0], patches]) if self.cls_token else patches

    @property
    def n_imgs_per_shard(self) -> int:
        return imgs_per_shard(self.max_patches_per_shard, len(self.layers), self.n_tokens_per_img)

    @property
    def img_nbytes(self) -> int:
        return len(self.layers) * self.n_tokens_per_img * self.d_vit * 4

    def metadata(self, n_imgs: int) -> Metadata:
        """The dump's ``metadata.json`` for ``n_imgs`` images."""
        return new_metadata(
            vit_family=self.vit_family, vit_ckpt=self.vit_ckpt, layers=self.layers,
            n_patches_per_img=self.n_patches_per_img, cls_token=self.cls_token,
            d_vit=self.d_vit, seed=self.seed, n_imgs=n_imgs,
            max_patches_per_shard=self.max_patches_per_shard, data=self.data,
        )  # fmt: skip


def hook_values(column: pa.Array, dtype: str, seq_len: int, width: int) -> np.ndarray:
    """A hook point's Tensor Structs, one ``[seq_len, width]`` per row laid end to end
    (as the model stage builds them), as one array ``[rows, seq_len, width]`` over their
    bytes (no copy)."""
    data = column.flatten()[0] if isinstance(column, pa.StructArray) else column
    offset_type = np.int64 if pa.types.is_large_binary(data.type) else np.int32
    offsets = np.frombuffer(data.buffers()[1], offset_type)[
        data.offset : data.offset + len(data) + 1
    ]
    itemsize = get_dtype(dtype).itemsize
    row_bytes = seq_len * width * itemsize
    if data.null_count or (np.diff(offsets) != row_bytes).any():
        raise DumpError(
            f"a sample row's activations are not [{seq_len}, {width}] {dtype} (every image "
            f"must have {seq_len} tokens of width {width})"
        )
    raw = np.frombuffer(data.buffers()[2], np.uint8)[offsets[0] : offsets[-1]]
    return raw.view(get_dtype(dtype).numpy).reshape(len(data), seq_len, width)


def _pwrite(fd: int, array: np.ndarray, offset: int) -> None:
    """All of ``array``'s bytes at ``offset`` (one ``pwrite`` takes at most ~2 GiB)."""
    view = memoryview(array).cast("B")
    while view:
        done = os.pwrite(fd, view, offset)
        view, offset = view[done:], offset + done


@dataclass(frozen=True)
class ShardsWritten:
    """What one task wrote: by shard, the slots it filled (``np.packbits`` of S flags)."""

    task_id: int
    shards: dict[int, np.ndarray]


class SaevShardWriter:
    """One task attempt's shards: images go to their slots (``image_id % S``) of
    their shard's file, written under the attempt's name and moved into the staging
    directory whole by ``finish``."""

    def __init__(self, job: SaevShardJob, task_id: int, attempt_id: int):
        self.job, self.task_id, self.attempt = job, task_id, f"{task_id}-{attempt_id}"
        self._files: dict[int, tuple[int, Path]] = {}
        self._slots: dict[int, np.ndarray] = {}

    def add(self, batch: pa.RecordBatch) -> None:
        """Write a batch of sample rows (``sample_id`` = ``image_id``, ``seq_len``, one
        Tensor Struct ``[seq_len, H]`` per hook column), in any order."""
        plan = self.job.plan
        if not batch.num_rows:
            return
        seq_len = batch.column("seq_len").to_numpy()
        if (seq_len != plan.seq_len).any():
            bad = int(np.flatnonzero(seq_len != plan.seq_len)[0])
            raise DumpError(
                f"image {batch.column('sample_id')[bad].as_py()} has {seq_len[bad]} tokens; "
                f"every image of a saev dump has {plan.seq_len} (CLS, registers, patches)"
            )
        acts = np.empty(
            (batch.num_rows, len(plan.layers), plan.n_tokens_per_img, plan.d_vit), "<f4"
        )
        for layer, column in enumerate(plan.columns):
            values = hook_values(batch.column(column), plan.dtype, plan.seq_len, plan.d_vit)
            acts[:, layer] = values[:, plan.tokens]  # F16/BF16 widen to float32 exactly
        ids = batch.column("sample_id").to_numpy().astype(np.int64)
        order = np.argsort(ids, kind="stable")
        ids, acts = ids[order], acts[order]
        shard, slot = np.divmod(ids, plan.n_imgs_per_shard)
        # runs of consecutive slots of one shard: one write each
        breaks = np.flatnonzero((np.diff(shard) != 0) | (np.diff(slot) != 1)) + 1
        for run in np.split(np.arange(len(ids)), breaks):
            s, first = int(shard[run[0]]), int(slot[run[0]])
            taken = self._taken(s)
            if taken[slot[run]].any():  # sorted ids: a repeat starts a run of its own
                raise DumpError(f"image {int(ids[run[0]])}: two sample rows of one image_id")
            taken[slot[run]] = True
            _pwrite(self._fd(s), acts[run[0] : run[-1] + 1], first * plan.img_nbytes)
            if taken.all():  # a full shard is done: a task may own thousands, fds are few
                self._publish(s)

    def _taken(self, shard: int) -> np.ndarray:
        if shard not in self._slots:
            self._slots[shard] = np.zeros(self.job.plan.n_imgs_per_shard, bool)
        return self._slots[shard]

    def _fd(self, shard: int) -> int:
        if shard not in self._files:
            path = self.job.tasks / f"{shard_file(shard)}.{self.attempt}"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            self._files[shard] = (fd, path)
            # the full shard shape: unwritten slots read as zeros, saev's padding
            os.ftruncate(fd, self.job.plan.n_imgs_per_shard * self.job.plan.img_nbytes)
        return self._files[shard][0]

    def _publish(self, shard: int) -> None:
        """Sync a shard's file and move it into the staging directory."""
        fd, path = self._files.pop(shard)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        # a retried attempt replaces the shard whole; after the commit the staging
        # directory is gone and a late attempt fails here, leaving nothing behind
        os.replace(path, self.job.staging / shard_file(shard))

    def finish(self) -> ShardsWritten:
        """Publish the shards still open (the last, partial one); returns what was
        written, for the driver's commit."""
        for s in list(self._files):
            self._publish(s)
        return ShardsWritten(self.task_id, {s: np.packbits(t) for s, t in self._slots.items()})

    def discard(self) -> None:
        """Delete this attempt's unfinished shard files."""
        for fd, path in self._files.values():
            os.close(fd)
            path.unlink(missing_ok=True)
        self._files.clear()


class SaevShardJob:
    """One dump written by the tasks of a Spark stage (the interface of the Spark writer's
    ``WriteJob`` that the extraction's stage writes use): made on the driver, which
    creates the staging directories; carried into the tasks (``partition`` gives each
    attempt its writer); ``commit``-ted by the driver with every task's result, or
    ``abort``-ed."""

    def __init__(self, plan: SaevPlan, dump_to: str | os.PathLike):
        self.plan = plan
        self.dump_to = Path(dump_to)
        self.created = not self.dump_to.exists()
        self.dump_to.mkdir(parents=True, exist_ok=True)
        self.staging = staging_path(self.dump_to / "dump")
        self.tasks = staging_path(self.dump_to / "dump", "tasks")
        self.staging.mkdir()
        self.tasks.mkdir()

    def partition(self, task_id: int, attempt_id: int) -> SaevShardWriter:
        return SaevShardWriter(self, task_id, attempt_id)

    def live(self) -> bool:
        """Whether the dump still takes shards (not committed nor aborted)."""
        return self.staging.is_dir()

    def commit(self, results: list[ShardsWritten]) -> Path:
        """Check that image ``0 .. n_imgs - 1`` each landed once, write ``metadata.json``
        and publish the dump under its hash; returns its directory. On failure the job
        is aborted."""
        try:
            meta = self.plan.metadata(self._n_imgs(results))
            write_metadata(self.staging, metadata_text(meta))
            _, problems, _ = check_shards(self.staging, meta)
            if problems:
                raise DumpError(f"saev dump of the extraction: {'; '.join(problems)}")
            final = publish(self.staging, self.dump_to / meta.hash)
            shutil.rmtree(self.tasks, ignore_errors=True)
            return final
        except BaseException:
            self.abort()
            raise

    def _n_imgs(self, results: list[ShardsWritten]) -> int:
        """The images written, checked to be image_id 0 .. n - 1 each once, each shard
        written by one task."""
        S, owner, ids = self.plan.n_imgs_per_shard, {}, {}
        for result in results:
            for s, bits in result.shards.items():
                if s in owner:
                    raise DumpError(
                        f"tasks {owner[s]} and {result.task_id} both wrote images of saev shard "
                        f"{s}: the image partitions must begin at multiples of "
                        f"n_imgs_per_shard = {S}"
                    )
                owner[s] = result.task_id
                ids[s] = s * S + np.flatnonzero(np.unpackbits(bits, count=S))
        if not ids:  # a task that cannot see the staging directory writes nothing
            raise DumpError(
                f"no image reached the saev dump in {self.dump_to}: it must be on storage "
                "every Spark worker sees (a local path of a one-machine session, or a mount)"
            )
        ids = np.concatenate([ids[s] for s in sorted(ids)])
        if ids[-1] != len(ids) - 1:  # the extraction numbers the readable images densely
            missing = np.setdiff1d(np.arange(ids[-1]), ids)
            raise DumpError(
                f"images {missing[:5].tolist()}{' ...' if len(missing) > 5 else ''} "
                f"({len(missing)} in all) of image_id 0 .. {int(ids[-1])} reached no task's "
                "shard: a saev dump holds images 0 .. n_imgs - 1"
            )
        return len(ids)

    def abort(self) -> None:
        """Delete what the tasks wrote; ``dump_to`` too when the job made it."""
        shutil.rmtree(self.staging, ignore_errors=True)
        shutil.rmtree(self.tasks, ignore_errors=True)
        if self.created:
            with contextlib.suppress(OSError):  # not empty: another dump is there
                self.dump_to.rmdir()


def _model_type(model: str) -> str:
    """The ``model_type`` of a local model directory's ``config.json``."""
    path = Path(model).expanduser() / "config.json"
    if not path.is_file():
        raise DumpError(
            f"saev_dump reads the model's type (its vit_family) from a local model directory's "
            f"config.json; {model!r} is not one: give the model's directory"
        )
    return str(json.loads(path.read_text()).get("model_type", ""))


@dataclass(frozen=True)
class _StageWrite:
    """``extract.outputs.StageWrite``'s two fields (interop does not import extract)."""

    job: SaevShardJob
    rows: Callable[[pa.RecordBatch], pa.RecordBatch]


def _select(samples: pa.RecordBatch, columns: list[str]) -> pa.RecordBatch:
    return samples.select(columns)


@dataclass(frozen=True)
class SaevDumpOutput:
    """An output format of the extraction (``extract.outputs.ExtractionOutput``): the
    image activations as a saev dump, ``saev/<HASH>/``, written by the model stage's
    tasks. Chosen by ``ExtractConfig.saev_dump``; ``max_patches_per_shard`` is the shard
    budget. Needs an image corpus, hook points of one width, one per transformer block,
    and a local (or mounted) output: saev's readers memory-map the shards."""

    model: str
    """The extraction's model: its ``config.json`` gives ``vit_family``."""
    max_patches_per_shard: int = MAX_PATCHES_PER_SHARD
    name: str = SAEV_DIR
    reads_rows: bool = False

    @classmethod
    def for_config(cls, config) -> SaevDumpOutput | None:
        """``config``: an ``extract.ExtractConfig``."""
        if not config.saev_dump:
            return None
        return cls(config.model, config.max_patches_per_shard)

    def target_refusal(self, target: str, local: bool) -> str | None:
        if local:  # each task moves its shards into place with a local rename
            return None
        return (
            f"saev_dump writes to a local or mounted directory, not to {target}: saev reads "
            "its shards with np.memmap, and the dump is published by a rename; extract to "
            "a local path (on Databricks a /dbfs/ or /Volumes/ path), or leave saev_dump off"
        )

    def widths_refusal(self, widths: dict[str, int]) -> str | None:
        if len(set(widths.values())) != 1:
            return (
                f"saev_dump needs hook points of one width (a dump's d_vit; its shards are "
                f"[img, layer, token, d_vit]); got {widths}"
            )
        return layers_refusal(list(widths))

    def plan(self, rows) -> SaevPlan:
        """The dump's plan from the extraction's ``extract.outputs.SampleRows``."""
        image = rows.image_tokens
        if image is None:
            raise DumpError(
                "saev_dump needs an image corpus (ExtractConfig.images, or a DataFrame of "
                "images): a saev dump holds a vision transformer's image activations"
            )
        model_type = _model_type(self.model)
        family = FAMILY_OF_MODEL_TYPE.get(model_type)
        if family is None:
            raise DumpError(
                f"saev_dump: no saev vit_family for a {model_type!r} model; protocol v1 "
                f"knows {list(VIT_FAMILIES)} (and plain ViTs, recorded as dinov2)"
            )
        return SaevPlan(
            columns=tuple(h.column for h in rows.hooks),
            layers=tuple(block_index(h.name) for h in rows.hooks),
            d_vit=next(iter(rows.widths.values())),
            dtype=rows.dtype,
            cls_token=bool(image.n_cls),
            n_registers=image.n_registers,
            n_patches_per_img=image.grid[0] * image.grid[1],
            max_patches_per_shard=self.max_patches_per_shard,
            vit_family=family,
            vit_ckpt=rows.metadata["model"],
            data={
                "type": "SparkImages",
                "corpus": rows.metadata["corpus"],
                "config_hash": rows.metadata["config_hash"],
            },
        )

    def images_per_partition_multiple(self, rows) -> int:
        """S: the job cuts the images at multiples of it, so one task writes each shard."""
        return self.plan(rows).n_imgs_per_shard

    def stage_writes(self, out, rows) -> list[_StageWrite]:
        """``out``: the extraction's ``DatasetLocation`` (local); ``rows``: its
        ``extract.outputs.SampleRows``."""
        plan = self.plan(rows)
        job = SaevShardJob(plan, out.local_file(self.name))
        return [_StageWrite(job, partial(_select, columns=["sample_id", "seq_len", *plan.columns]))]

    def write(self, out, rows) -> None:
        """The dump was published by the stage's commit; check it is whole."""
        from .dump import verify_dump

        verify_dump(out.local_file(self.name))
