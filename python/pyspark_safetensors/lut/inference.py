"""LUT inference: a linear layer approximated by its SAE and the precomputed products.

    a = ReLU(x @ encoder_weight.T + encoder_bias);  (v, i) = TopK(a, k_active)
    out = sum_j v_j * precomputed_products[i_j] + bias_product (+ the layer's own bias)

Optional compensation with ``m`` dims: ``x_hat`` is the SAE's reconstruction from the same
top-k code; the ``m`` input dims with the largest ``|x - x_hat|`` get their exact
contribution ``(x - x_hat)[dims] @ W_target[dims]`` added. Because the table part equals
``x_hat @ W_target``, this makes those dims exact (the spec's "online compensation").
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .spec import LUTError, validate_lut


def load_layer_file(path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> dict:
    """The six tensors of a ``.lut.safetensors`` file as torch tensors of ``dtype``."""
    from safetensors.torch import load_file

    if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO would block the read forever
        raise LUTError(f"{path}: not a regular file; a LUT layer file must be a plain file")
    return {k: v.to(dtype) for k, v in load_file(os.fspath(path)).items()}


class LUTLinear(nn.Module):
    """A drop-in replacement for ``nn.Linear(input_dim, output_dim)`` computed from a LUT.

    ``bias``: the original layer's bias (the LUT does not include it). ``weight``: the
    original ``[output_dim, input_dim]`` weight, needed only when ``compensate > 0``.
    Tensors are kept in ``dtype`` (float32 by default: CPUs have no fast float16 matmul)."""

    def __init__(
        self,
        tensors: dict[str, torch.Tensor],
        k_active: int,
        *,
        bias: torch.Tensor | None = None,
        weight: torch.Tensor | None = None,
        compensate: int = 0,
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        num_basis, self.in_features = tensors["encoder_weight"].shape
        self.out_features = tensors["precomputed_products"].shape[1]
        if not 0 < k_active <= num_basis:
            raise LUTError(f"k_active {k_active} outside 1..num_basis {num_basis}")
        if compensate and weight is None:
            raise LUTError("compensate > 0 needs the original layer weight")
        if not 0 <= compensate <= self.in_features:
            raise LUTError(f"compensate {compensate} outside 0..input_dim {self.in_features}")
        self.k_active, self.compensate = k_active, compensate
        for name, t in tensors.items():
            self.register_buffer(name, t.to(dtype))
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype))
        # W_target = weight.T, rows indexed by input dim for the compensation gather
        self.register_buffer(
            "w_target",
            None
            if weight is None or not compensate
            else weight.detach().t().to(dtype).contiguous(),
        )

    @classmethod
    def from_file(cls, path: str | os.PathLike, k_active: int, **kwargs) -> LUTLinear:
        dtype = kwargs.get("dtype", torch.float32)
        return cls(load_layer_file(path, dtype), k_active, **kwargs)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pre = F.linear(x, self.encoder_weight, self.encoder_bias).relu_()
        return pre.topk(self.k_active, dim=-1, sorted=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, self.in_features).to(self.encoder_weight.dtype)
        values, indices = self.encode(x)
        out = F.embedding_bag(
            indices, self.precomputed_products, per_sample_weights=values, mode="sum"
        )
        out = out + self.bias_product
        if self.compensate:
            x_hat = F.embedding_bag(
                indices, self.decoder_weight, per_sample_weights=values, mode="sum"
            )
            residual = x - (x_hat + self.decoder_bias)
            dims = residual.abs().topk(self.compensate, dim=-1, sorted=False).indices
            out = out + F.embedding_bag(
                dims, self.w_target, per_sample_weights=residual.gather(1, dims), mode="sum"
            )
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"num_basis={self.encoder_weight.shape[0]}, k_active={self.k_active}, "
            f"compensate={self.compensate}"
        )


def dense_lut_reference(tensors: dict[str, torch.Tensor], x: torch.Tensor, k: int) -> torch.Tensor:
    """The spec's formula computed densely (a dense code times the full table); the
    sparse ``LUTLinear`` must match it."""
    a = torch.relu(x @ tensors["encoder_weight"].T + tensors["encoder_bias"])
    v, i = a.topk(k, dim=-1)
    z = torch.zeros_like(a).scatter(-1, i, v)
    return z @ tensors["precomputed_products"] + tensors["bias_product"]


def _find_linear(model: nn.Module, name: str) -> tuple[str, nn.Linear]:
    modules = dict(model.named_modules())
    if name in modules:
        found = [name]
    else:  # LUT names come from the weight file, which may carry a prefix the module lacks
        found = [m for m in modules if m and (name.endswith("." + m) or m.endswith("." + name))]
    if len(found) != 1:
        raise LUTError(f"layer {name!r} matches {found or 'no'} module(s) of the model")
    module = modules[found[0]]
    if not isinstance(module, nn.Linear):
        raise LUTError(f"{found[0]} is a {type(module).__name__}, not nn.Linear")
    return found[0], module


def patch_model(
    model: nn.Module,
    lut_dir: str | os.PathLike,
    *,
    compensate: int = 0,
    k_active: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> list[str]:
    """Replace every linear layer listed in ``lut_dir/metadata.json`` by a ``LUTLinear``
    (keeping the layer's bias; its weight too when ``compensate > 0``). Returns the
    module names replaced."""
    lut_dir = Path(lut_dir)
    meta = validate_lut(lut_dir)
    k = k_active or meta["sae_config"]["k_active"]
    replaced = []
    for name, entry in meta["layers"].items():
        qualified, linear = _find_linear(model, name)
        if (linear.in_features, linear.out_features) != (entry["input_dim"], entry["output_dim"]):
            raise LUTError(
                f"{qualified}: the model's layer is {linear.in_features}->{linear.out_features}, "
                f"the LUT {entry['input_dim']}->{entry['output_dim']}"
            )
        lut = LUTLinear.from_file(
            lut_dir / entry["file"],
            k,
            bias=linear.bias,
            weight=linear.weight if compensate else None,
            compensate=compensate,
            dtype=dtype,
        ).to(linear.weight.device)
        parent_name, _, child = qualified.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, lut)
        replaced.append(qualified)
    return replaced
