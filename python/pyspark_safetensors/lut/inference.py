"""LUT inference: a linear layer approximated by its SAE and the precomputed products.

    a = ReLU(x @ encoder_weight.T + encoder_bias);  (v, i) = TopK(a, k_active)
    out = sum_j v_j * precomputed_products[i_j] + bias_product (+ the layer's own bias)

Optional compensation with ``m`` dims: ``x_hat`` is the SAE's reconstruction from the same
top-k code; the ``m`` input dims with the largest ``|x - x_hat|`` get their exact
contribution ``(x - x_hat)[dims] @ W_target[dims]`` added. Because the table part equals
``x_hat @ W_target``, this makes those dims exact (the spec's "online compensation").

Layers that read one input through one SAE (q, k and v; gate and up) share one
``LUTEncoder``: ``patch_model`` finds them by comparing the files' encoder tensors, and the
encoder keeps its last input and result, so the layers fed that input encode it once.

A whole MLP block (``kind: "mlp"``, a transcoder's LUT) runs as ``LUTMLP``: the same encode
and gather, the gathered rows being the block's output itself, plus ``x @ skip_weight.T``
for a skip transcoder; ``patch_model`` swaps the block's module (Llama's gate, up, act and
down) for it.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .spec import MLP, LUTError, entry_kind, file_kind, validate_lut


def load_layer_file(path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> dict:
    """The six tensors of a ``.lut.safetensors`` file as torch tensors of ``dtype``."""
    from safetensors.torch import load_file

    if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO would block the read forever
        raise LUTError(f"{path}: not a regular file; a LUT layer file must be a plain file")
    return {k: v.to(dtype) for k, v in load_file(os.fspath(path)).items()}


class LUTEncoder(nn.Module):
    """The spec's step A, ``ReLU(x @ weight.T + bias)`` then the top ``k_active``, for every
    ``LUTLinear`` that holds it.

    Held by several layers (``users > 1``), it keeps a copy of its last input with the
    result: a call with an input equal to that one, element for element, returns the kept
    result instead of a second ``[N, input_dim] x [input_dim, num_basis]`` matmul. Equality
    of content, not identity, decides, so a new input, one modified in place, or a freed
    tensor whose memory was reused is encoded afresh; the compare costs ``N x input_dim``
    reads against the matmul's ``num_basis`` times as many multiply-adds. Inputs that
    require a gradient are never served from the copy (the gradient would reach the first
    caller's tensor)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, k_active: int):
        super().__init__()
        num_basis = weight.shape[0]
        if not 0 < k_active <= num_basis:
            raise LUTError(f"k_active {k_active} outside 1..num_basis {num_basis}")
        self.register_buffer("weight", weight)
        self.register_buffer("bias", bias)
        self.k_active = k_active
        self.users = 0
        self.encodes = 0  # matmuls run, for callers that check the sharing
        self._last: tuple | None = None

    def _key(self) -> tuple:
        # the weights too: ``.to()`` or an in-place change invalidates the kept result
        return tuple(
            (t.data_ptr(), t.dtype, t.device, None if t.is_inference() else t._version)
            for t in (self.weight, self.bias)
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(values, indices)``, each ``[N, k_active]``, of ``x [N, input_dim]``."""
        keep = self.users > 1 and not (x.requires_grad and torch.is_grad_enabled())
        if keep and self._last is not None:
            key, seen, values, indices = self._last
            if (
                key == self._key()
                and seen.shape == x.shape
                and seen.dtype == x.dtype
                and seen.device == x.device
                and torch.equal(seen, x)
            ):
                return values, indices
        self._last = None  # never hold an old input longer than one call
        pre = F.linear(x, self.weight, self.bias).relu_()
        values, indices = pre.topk(self.k_active, dim=-1, sorted=False)
        self.encodes += 1
        if keep:
            self._last = (self._key(), x.detach().clone(), values, indices)
        return values, indices

    def same_as(self, weight: torch.Tensor, bias: torch.Tensor) -> bool:
        """Whether ``weight``/``bias`` are this encoder's tensors, element for element."""
        return (
            weight.shape == self.weight.shape
            and weight.dtype == self.weight.dtype
            and torch.equal(bias.to(self.bias.device), self.bias)
            and torch.equal(weight.to(self.weight.device), self.weight)
        )

    def extra_repr(self) -> str:
        num_basis, input_dim = self.weight.shape
        return (
            f"input_dim={input_dim}, num_basis={num_basis}, k_active={self.k_active}, "
            f"users={self.users}"
        )


class LUTLinear(nn.Module):
    """A drop-in replacement for ``nn.Linear(input_dim, output_dim)`` computed from a LUT.

    ``bias``: the original layer's bias (the LUT does not include it). ``weight``: the
    original ``[output_dim, input_dim]`` weight, needed only when ``compensate > 0``.
    ``encoder``: a ``LUTEncoder`` shared with other layers; it must hold this file's
    encoder tensors (checked). Tensors are kept in ``dtype`` (float32 by default: CPUs
    have no fast float16 matmul)."""

    def __init__(
        self,
        tensors: dict[str, torch.Tensor],
        k_active: int,
        *,
        bias: torch.Tensor | None = None,
        weight: torch.Tensor | None = None,
        compensate: int = 0,
        dtype: torch.dtype = torch.float32,
        encoder: LUTEncoder | None = None,
    ):
        super().__init__()
        if "skip_weight" in tensors:
            raise LUTError(
                "these tensors are a skip transcoder's MLP-block LUT, not a linear layer's: "
                "use LUTMLP"
            )
        num_basis, self.in_features = tensors["encoder_weight"].shape
        self.out_features = tensors["precomputed_products"].shape[1]
        if not 0 < k_active <= num_basis:
            raise LUTError(f"k_active {k_active} outside 1..num_basis {num_basis}")
        if compensate and weight is None:
            raise LUTError("compensate > 0 needs the original layer weight")
        if not 0 <= compensate <= self.in_features:
            raise LUTError(f"compensate {compensate} outside 0..input_dim {self.in_features}")
        self.k_active, self.compensate = k_active, compensate
        enc_w, enc_b = (tensors[n].to(dtype) for n in ("encoder_weight", "encoder_bias"))
        if encoder is None:
            encoder = LUTEncoder(enc_w, enc_b, k_active)
        elif encoder.k_active != k_active or not encoder.same_as(enc_w, enc_b):
            raise LUTError("the shared encoder is not this layer's (other tensors, dtype or k)")
        encoder.users += 1
        self.encoder = encoder
        for name, t in tensors.items():
            if name not in ("encoder_weight", "encoder_bias"):
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
        """The layer of one ``.lut.safetensors`` file (an MLP block's file is refused)."""
        _refuse_mlp_file(path)
        dtype = kwargs.get("dtype", torch.float32)
        return cls(load_layer_file(path, dtype), k_active, **kwargs)

    @property
    def encoder_weight(self) -> torch.Tensor:
        return self.encoder.weight

    @property
    def encoder_bias(self) -> torch.Tensor:
        return self.encoder.bias

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.encoder(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, self.in_features).to(self.encoder.weight.dtype)
        values, indices = self.encoder(x)
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
            f"num_basis={self.encoder.weight.shape[0]}, k_active={self.k_active}, "
            f"compensate={self.compensate}, shared_encoder={self.encoder.users > 1}"
        )


def _refuse_mlp_file(path: str | os.PathLike) -> None:
    if file_kind(path) == MLP:
        raise LUTError(
            f"{path}: an MLP block's LUT (a transcoder's, kind 'mlp'), which replaces the whole "
            "block, not a linear layer: load it with LUTMLP.from_file, load_lut_mlps or "
            "patch_model"
        )


class LUTMLP(nn.Module):
    """A whole MLP block computed from a transcoder's LUT (``kind: "mlp"``): a drop-in for
    the block's module, ``[..., input_dim] -> [..., output_dim]``:

        (v, i) = TopK(ReLU(x @ encoder_weight.T + encoder_bias), k_active)
        out = sum_j v_j * precomputed_products[i_j] + bias_product (+ x @ skip_weight.T)

    which is the transcoder's own output (its decoder rows are ``precomputed_products``).
    Tensors are kept in ``dtype`` (float32 by default); the output has the input's dtype,
    as the block's had."""

    def __init__(
        self, tensors: dict[str, torch.Tensor], k_active: int, *, dtype: torch.dtype = torch.float32
    ):
        super().__init__()
        if "decoder_weight" in tensors:
            raise LUTError(
                "these tensors are a linear layer's LUT (they hold decoder_weight), not an MLP "
                "block's: use LUTLinear"
            )
        if tensors["precomputed_products"].shape[0] != tensors["encoder_weight"].shape[0]:
            raise LUTError(
                "a cross-layer transcoder's block (its products span the codes of several "
                "blocks, 'sources'): run the LUT's blocks together with "
                "circuits.lut_replacement and ReplacementModel"
            )
        self.in_features = tensors["encoder_weight"].shape[1]
        self.out_features = tensors["precomputed_products"].shape[1]
        enc_w, enc_b = (tensors[n].to(dtype) for n in ("encoder_weight", "encoder_bias"))
        self.encoder = LUTEncoder(enc_w, enc_b, k_active)  # checks k_active
        self.encoder.users += 1
        self.k_active = k_active
        self.register_buffer("precomputed_products", tensors["precomputed_products"].to(dtype))
        self.register_buffer("bias_product", tensors["bias_product"].to(dtype))
        skip = tensors.get("skip_weight")
        self.register_buffer("skip_weight", None if skip is None else skip.to(dtype))

    @classmethod
    def from_file(cls, path: str | os.PathLike, k_active: int, **kwargs) -> LUTMLP:
        """The block of one MLP ``.lut.safetensors`` file (a linear layer's is refused)."""
        if file_kind(path) != MLP:
            raise LUTError(
                f"{path}: a linear layer's LUT, not an MLP block's (kind 'mlp'): load it with "
                "LUTLinear.from_file"
            )
        return cls(load_layer_file(path, kwargs.get("dtype", torch.float32)), k_active, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, dtype = x.shape, x.dtype
        x = x.reshape(-1, self.in_features).to(self.encoder.weight.dtype)
        values, indices = self.encoder(x)
        out = F.embedding_bag(
            indices, self.precomputed_products, per_sample_weights=values, mode="sum"
        )
        out = out + self.bias_product
        if self.skip_weight is not None:
            out = torch.addmm(out, x, self.skip_weight.T)
        return out.reshape(*shape[:-1], self.out_features).to(dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"num_basis={self.encoder.weight.shape[0]}, k_active={self.k_active}, "
            f"skip={self.skip_weight is not None}"
        )


def dense_lut_reference(tensors: dict[str, torch.Tensor], x: torch.Tensor, k: int) -> torch.Tensor:
    """The spec's formula computed densely (a dense code times the full table); the
    sparse ``LUTLinear`` must match it."""
    a = torch.relu(x @ tensors["encoder_weight"].T + tensors["encoder_bias"])
    v, i = a.topk(k, dim=-1)
    z = torch.zeros_like(a).scatter(-1, i, v)
    return z @ tensors["precomputed_products"] + tensors["bias_product"]


@dataclass(frozen=True)
class _Projection:
    """A model's linear map as a LUT replaces it: ``nn.Linear`` (weight ``[out, in]``) or
    ``transformers``' ``Conv1D`` of GPT-2 style models (weight ``[in, out]``, seen
    transposed)."""

    name: str
    in_features: int
    out_features: int
    weight: torch.Tensor
    bias: torch.Tensor | None


def _find_module(model: nn.Module, name: str) -> tuple[str, nn.Module]:
    """The module a LUT entry names, and its name in ``model``."""
    modules = dict(model.named_modules())
    if name in modules:
        found = [name]
    else:  # LUT names come from the weight file, which may carry a prefix the module lacks
        found = [m for m in modules if m and (name.endswith("." + m) or m.endswith("." + name))]
    if len(found) != 1:
        raise LUTError(f"layer {name!r} matches {found or 'no'} module(s) of the model")
    return found[0], modules[found[0]]


def _as_projection(name: str, module: nn.Module) -> _Projection | None:
    if isinstance(module, nn.Linear):
        return _Projection(
            name, module.in_features, module.out_features, module.weight, module.bias
        )
    if type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None:
        n_in, n_out = module.weight.shape  # y = x @ weight + bias
        return _Projection(name, n_in, n_out, module.weight.T, module.bias)
    return None


def _find_projection(model: nn.Module, name: str) -> _Projection:
    qualified, module = _find_module(model, name)
    projection = _as_projection(qualified, module)
    if projection is None:
        raise LUTError(
            f"{qualified} is a {type(module).__name__}, not nn.Linear (nor GPT-2's Conv1D)"
        )
    return projection


def _find_block(model: nn.Module, name: str, input_dim: int, output_dim: int) -> str:
    """The qualified name of the MLP block an MLP LUT replaces, checked: a module of linear
    layers (not one layer) of which one reads ``input_dim`` and one writes ``output_dim``."""
    qualified, module = _find_module(model, name)
    if _as_projection(qualified, module) is not None:
        raise LUTError(
            f"{qualified} is a single {type(module).__name__}; an MLP LUT replaces a whole block"
        )
    dims = [p for n, m in module.named_modules() if (p := _as_projection(n, m)) is not None]
    if not any(p.in_features == input_dim for p in dims) or not any(
        p.out_features == output_dim for p in dims
    ):
        raise LUTError(
            f"{qualified}: its layers ({[(p.in_features, p.out_features) for p in dims]}) do not "
            f"read {input_dim} and write {output_dim} as the LUT's block does"
        )
    return qualified


class EncoderGroups:
    """Hands out one ``LUTEncoder`` per distinct encoder: layers whose files hold equal
    ``encoder_weight``/``encoder_bias`` (same dtype, same device) get the same object.
    Candidates are found by the bias bytes, then confirmed on the whole weight."""

    def __init__(self, k_active: int, dtype: torch.dtype = torch.float32):
        self.k_active, self.dtype = k_active, dtype
        self._by_bias: dict[tuple, list[LUTEncoder]] = {}

    def encoder(
        self, tensors: dict[str, torch.Tensor], device: torch.device | str = "cpu"
    ) -> LUTEncoder:
        weight = tensors["encoder_weight"].to(self.dtype)
        bias = tensors["encoder_bias"].to(self.dtype)
        device = torch.device(device)
        key = (str(device), tuple(weight.shape), bias.cpu().view(torch.uint8).numpy().tobytes())
        found = self._by_bias.setdefault(key, [])
        for encoder in found:
            if encoder.same_as(weight, bias):
                return encoder
        encoder = LUTEncoder(weight, bias, self.k_active).to(device)
        found.append(encoder)
        return encoder

    def __len__(self) -> int:
        return sum(len(v) for v in self._by_bias.values())


def load_lut_layers(
    lut_dir: str | os.PathLike,
    layers: list[str] | None = None,
    *,
    k_active: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> dict[str, LUTLinear]:
    """``{layer: LUTLinear}`` for ``layers`` (default: every linear layer of ``lut_dir``),
    without bias or compensation; layers whose files carry the same encoder share one.
    An MLP block named in ``layers`` is refused (``load_lut_mlps`` loads those)."""
    lut_dir = Path(lut_dir)
    meta = validate_lut(lut_dir)
    k = k_active or meta["sae_config"]["k_active"]
    groups = EncoderGroups(k, dtype)
    entries = meta["layers"]
    out = {}
    if layers is None:
        layers = [name for name, entry in entries.items() if entry_kind(entry) != MLP]
    for name in layers:
        if name not in entries:
            raise LUTError(f"{lut_dir}: no LUT for layer {name!r}")
        if entry_kind(entries[name]) == MLP:
            raise LUTError(
                f"{lut_dir / entries[name]['file']}: {name!r} is an MLP block's LUT (kind "
                "'mlp'), not a linear layer's: load it with load_lut_mlps or patch_model"
            )
        tensors = load_layer_file(lut_dir / entries[name]["file"], dtype)
        encoder = groups.encoder(tensors, device)
        out[name] = LUTLinear(tensors, k, dtype=dtype, encoder=encoder).to(device)
    return out


def load_lut_mlps(
    lut_dir: str | os.PathLike,
    blocks: list[str] | None = None,
    *,
    k_active: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> dict[str, LUTMLP]:
    """``{block: LUTMLP}`` for ``blocks`` (default: every MLP block of ``lut_dir``); a
    linear layer named in ``blocks`` is refused (``load_lut_layers`` loads those)."""
    lut_dir = Path(lut_dir)
    meta = validate_lut(lut_dir)
    k = k_active or meta["sae_config"]["k_active"]
    entries = meta["layers"]
    if blocks is None:
        blocks = [name for name, entry in entries.items() if entry_kind(entry) == MLP]
    out = {}
    for name in blocks:
        if name not in entries:
            raise LUTError(f"{lut_dir}: no LUT for block {name!r}")
        if entry_kind(entries[name]) != MLP:
            raise LUTError(
                f"{lut_dir / entries[name]['file']}: {name!r} is a linear layer's LUT, not an "
                "MLP block's: load it with load_lut_layers"
            )
        tensors = load_layer_file(lut_dir / entries[name]["file"], dtype)
        out[name] = LUTMLP(tensors, k, dtype=dtype).to(device)
    return out


def patch_model(
    model: nn.Module,
    lut_dir: str | os.PathLike,
    *,
    compensate: int = 0,
    k_active: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> list[str]:
    """Replace every linear layer listed in ``lut_dir/metadata.json`` (``nn.Linear``, or
    GPT-2's ``Conv1D``) by a ``LUTLinear``
    (keeping the layer's bias; its weight too when ``compensate > 0``), and every MLP block
    listed (``kind: "mlp"``, e.g. Llama's ``model.layers.0.mlp``: gate, up, act and down) by
    a ``LUTMLP`` (``compensate`` does not apply to it). Layers whose files carry the same
    encoder share one ``LUTEncoder``, so those that read one input (q, k and v; gate and
    up) encode it once per forward. Returns the module names replaced."""
    lut_dir = Path(lut_dir)
    meta = validate_lut(lut_dir)
    k = k_active or meta["sae_config"]["k_active"]
    groups = EncoderGroups(k, dtype)
    replaced = []
    for name, entry in meta["layers"].items():
        if entry_kind(entry) == MLP:
            qualified = _find_block(model, name, entry["input_dim"], entry["output_dim"])
            device = next(model.get_submodule(qualified).parameters()).device
            tensors = load_layer_file(lut_dir / entry["file"], dtype)
            _set_module(model, qualified, LUTMLP(tensors, k, dtype=dtype).to(device))
            replaced.append(qualified)
            continue
        layer = _find_projection(model, name)
        qualified = layer.name
        if (layer.in_features, layer.out_features) != (entry["input_dim"], entry["output_dim"]):
            raise LUTError(
                f"{qualified}: the model's layer is {layer.in_features}->{layer.out_features}, "
                f"the LUT {entry['input_dim']}->{entry['output_dim']}"
            )
        tensors = load_layer_file(lut_dir / entry["file"], dtype)
        lut = LUTLinear(
            tensors,
            k,
            bias=layer.bias,
            weight=layer.weight if compensate else None,
            compensate=compensate,
            dtype=dtype,
            encoder=groups.encoder(tensors, layer.weight.device),
        ).to(layer.weight.device)
        _set_module(model, qualified, lut)
        replaced.append(qualified)
    return replaced


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)
