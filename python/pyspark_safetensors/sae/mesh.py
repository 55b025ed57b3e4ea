"""DeviceMesh helpers: the ``DimMap`` placement abstraction and collectives that are no-ops
without a mesh, so model code is written once for no mesh, ``("data",)``, ``("model",)``
or ``("data", "model")``.

Rank rules: a mesh dimension that is absent (or the whole mesh being ``None``) behaves as
size 1; every collective over it returns its input unchanged.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from types import MappingProxyType
from typing import TYPE_CHECKING, NoReturn

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..format.errors import InvalidArgumentError

# torch.distributed.tensor (DTensor: half a second of imports) loads where a mesh is used,
# not in the processes that only encode with an SAE (the features job's workers, the LUTs).
if TYPE_CHECKING:
    from torch.distributed.tensor import Placement

DATA, MODEL = "data", "model"


@dataclass(frozen=True)
class DimMap:
    """Which tensor dim each named mesh dimension shards; mesh dims absent from the map
    replicate. ``DimMap({"model": 0})`` shards dim 0 across "model" on any mesh.

    Negative dims count from the end and are resolved against the tensor's rank when a
    shape is known (``placements(mesh, ndim)``). Uneven sizes follow DTensor's rule (that
    of ``torch.chunk``: the first shards are one larger); ``local_shape`` refuses them so
    that callers choose divisible sizes instead of silently ragged shards.
    """

    dims: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self):
        taken = list(self.dims.values())
        if len(set(taken)) != len(taken):
            raise ValueError(f"DimMap {dict(self.dims)} shards one tensor dim along two mesh dims")
        object.__setattr__(self, "dims", MappingProxyType(dict(self.dims)))

    def _dim(self, name: str, ndim: int | None) -> int:
        d = self.dims[name]
        if d < 0:
            if ndim is None:
                raise ValueError(f"DimMap dim {d} for {name!r} is negative: pass ndim")
            d += ndim
        if ndim is not None and not 0 <= d < ndim:
            raise ValueError(f"DimMap dim {self.dims[name]} for {name!r} outside a {ndim}-d tensor")
        return d

    def placements(self, mesh: DeviceMesh, ndim: int | None = None) -> tuple[Placement, ...]:
        """The placement tuple for ``mesh``, in its dimension order. Names the mesh lacks
        are ignored: a map written for ("data", "model") works on ("model",) or ("data",)."""
        from torch.distributed.tensor import Replicate, Shard

        names = mesh.mesh_dim_names or ()
        return tuple(
            Shard(self._dim(name, ndim)) if name in self.dims else Replicate() for name in names
        )

    def local_shape(self, shape: tuple[int, ...], mesh: DeviceMesh | None) -> tuple[int, ...]:
        """This rank's shard shape; raises if a sharded dim does not divide evenly."""
        out = list(shape)
        for name in self.dims:
            size = mesh_dim_size(mesh, name)
            d = self._dim(name, len(shape))
            if out[d] % size:
                raise ValueError(
                    f"dim {d} of size {shape[d]} does not split evenly over {size} {name!r} ranks"
                )
            out[d] //= size
        return tuple(out)

    def distribute(self, full: torch.Tensor, mesh: DeviceMesh | None) -> torch.Tensor:
        """This rank's local shard of ``full`` (which every rank holds identically)."""
        if mesh is None:
            return full
        from torch.distributed.tensor import distribute_tensor

        self.local_shape(tuple(full.shape), mesh)
        return distribute_tensor(full, mesh, self.placements(mesh, full.ndim)).to_local()

    def gather(self, local: torch.Tensor, mesh: DeviceMesh | None) -> torch.Tensor:
        """The full tensor from every rank's local shard (a collective on every rank)."""
        if mesh is None:
            return local
        from torch.distributed.tensor import DTensor, Replicate

        placements = self.placements(mesh, local.ndim)
        if all(isinstance(p, Replicate) for p in placements):
            return local
        return DTensor.from_local(local, mesh, placements, run_check=False).full_tensor()


def mesh_dim_size(mesh: DeviceMesh | None, name: str) -> int:
    if mesh is None or name not in (mesh.mesh_dim_names or ()):
        return 1
    return mesh.size(mesh.mesh_dim_names.index(name))


def mesh_rank(mesh: DeviceMesh | None, name: str) -> int:
    """This process's coordinate along mesh dim ``name`` (0 when absent)."""
    if mesh is None or name not in (mesh.mesh_dim_names or ()):
        return 0
    return mesh.get_local_rank(name)


def mesh_group(mesh: DeviceMesh | None, name: str):
    """The process group of mesh dim ``name``, or None when it is absent or of size 1."""
    if mesh_dim_size(mesh, name) == 1:
        return None
    return mesh.get_group(name)


def all_reduce(t: torch.Tensor, mesh: DeviceMesh | None, name: str, op: str = "sum"):
    """In-place all-reduce over mesh dim ``name`` (``op``: sum, mean, max); returns ``t``."""
    group = mesh_group(mesh, name)
    if group is None:
        return t
    reduce_op = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
    dist.all_reduce(t, reduce_op[op], group=group)
    if op == "mean":
        t /= mesh_dim_size(mesh, name)
    return t


def all_gather_cat(t: torch.Tensor, mesh: DeviceMesh | None, name: str, dim: int = 0):
    """Concatenate every rank's ``t`` along ``dim``, in rank order (no autograd)."""
    group = mesh_group(mesh, name)
    if group is None:
        return t
    parts = [torch.empty_like(t) for _ in range(mesh_dim_size(mesh, name))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


class _ReduceFromModel(torch.autograd.Function):
    """Forward: sum the partial results of the model ranks. Backward: identity — every
    model rank computes the same loss from the summed value, so each partial receives
    that loss's gradient once (Megatron's reduce-from-model-parallel region)."""

    @staticmethod
    def forward(ctx, t, group):
        t = t.clone()
        dist.all_reduce(t, group=group)
        return t

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _CopyToModel(torch.autograd.Function):
    """Forward: identity on a replicated input. Backward: sum the model ranks' gradients,
    each of which saw only its shard of the weights."""

    @staticmethod
    def forward(ctx, t, group):
        ctx.group = group
        return t

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def reduce_from_model(t: torch.Tensor, mesh: DeviceMesh | None) -> torch.Tensor:
    group = mesh_group(mesh, MODEL)
    return t if group is None else _ReduceFromModel.apply(t, group)


def copy_to_model(t: torch.Tensor, mesh: DeviceMesh | None) -> torch.Tensor:
    group = mesh_group(mesh, MODEL)
    return t if group is None else _CopyToModel.apply(t, group)


def make_mesh(data_parallel_size: int, model_parallel_size: int) -> DeviceMesh | None:
    """The ("data", "model") mesh over the launched world (torchrun's environment), or None
    for a single process. Initialises the process group: nccl with CUDA, else gloo."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if data_parallel_size * model_parallel_size != world:
        raise InvalidArgumentError(
            f"data_parallel_size {data_parallel_size} x model_parallel_size "
            f"{model_parallel_size} = {data_parallel_size * model_parallel_size}, but the "
            f"world has {world} processes (torchrun --nproc-per-node)"
        )
    if world == 1:
        return None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not dist.is_initialized():
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(
            "nccl" if device == "cuda" else "gloo", timeout=timedelta(minutes=10)
        )
    return init_device_mesh(
        device, (data_parallel_size, model_parallel_size), mesh_dim_names=(DATA, MODEL)
    )


def is_main_process() -> bool:
    """Rank 0 of the process group, or of torchrun's world before the group exists (the
    one process that prints progress, warnings and summaries)."""
    if dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0") == "0"


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def exit_worker(code: int) -> NoReturn:
    """End a torchrun worker with ``code``, skipping interpreter finalisation when it is
    one of several processes. Why: after the last collective returns, a gloo worker thread
    may still be releasing that collective's tensors, which takes the GIL; if the
    interpreter is finalising by then, the thread is unwound inside C++ and the process
    aborts (SIGABRT, "terminate called without an active exception") after its work is
    done and saved. ``destroy_process_group`` does not join those threads. Everything the
    trainer writes is closed before this; stdio is flushed here."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        sys.exit(code)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
