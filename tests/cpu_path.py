"""One code path of the numeric libraries on every x86-64 CPU with AVX2, so that a figure
that comes out of training is the same bits on an AMD EPYC and on an Intel Xeon with AMX.

Left alone, each library picks its kernels by the CPU it finds, and a trained figure
follows them (a toy-ViT AUROC margin of 0.068 on one machine was 0.020 on another):

- ATen's vectorised kernels (softmax, GELU, reductions) by ISA: ``ATEN_CPU_CAPABILITY``
  caps them at AVX2;
- MKL (torch's GEMM, and its vector maths: ``exp``, ``log``, ``tanh``, ``sqrt``) by vendor
  and ISA. Only the ``COMPATIBLE`` branch of its conditional numerical reproducibility is
  one path on both vendors: on an AMD CPU MKL runs a path of its own whatever branch is
  asked for (the AVX2 and SSE4.2 branches gave the default's bits there), and on an Intel
  one the AVX2 branch gives other bits. It costs GEMM speed (2.2x slower at
  2048 x 512 x 2048 on an EPYC);
- oneDNN (convolutions; AMX for bf16) by ISA: ``ONEDNN_MAX_CPU_ISA`` caps it at AVX2;
- numpy's own SIMD loops (float64 ``exp``, ``log``, ``pow`` differ between its AVX-512
  and AVX2 builds): ``NPY_DISABLE_CPU_FEATURES`` drops the AVX-512 targets; its BLAS
  (OpenBLAS) follows ``OPENBLAS_CORETYPE``, set to Haswell unless the machine sets it.

What no variable pins: MKL's vector ``sqrt`` under ``COMPATIBLE`` is built on the CPU's
approximate reciprocal square root, whose bits differ between vendors, so torch's
``sqrt`` is not reproducible across CPUs. Adam's ``foreach`` step uses it; its ``fused``
step (ATen's own kernel, correctly rounded) does not: the project's trainers take the
fused step on CPU. Torch's thread count changes the order of parallel reductions, and on
this path a GEMM's bits too: at 2 threads a row's result can depend on the rows beside it
in the batch (at 1 thread it did not, nor on the EPYC's own MKL path). The same figure
needs the same threads and batches: compare a Spark job with a loop at one thread each
(Spark's Python workers run one), over the same chunks.

``python tests/cpu_path.py`` prints the fingerprint of each kernel the trained tests use;
``tests/test_cpu_path.py`` checks that the pinned path gives the same fingerprints on CPUs
emulated by ``qemu-x86_64`` (an Intel Haswell, an AMD EPYC-Rome: other vendor, no AVX-512,
other caches) as on this one.
"""

from __future__ import annotations

import hashlib
import os
import sys

#: The environment of the pinned path, read by each library as it loads (so set before
#: torch or numpy is imported, in every process: Spark's workers and torchrun's inherit it).
PINNED = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_CBWR": "COMPATIBLE",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "NPY_DISABLE_CPU_FEATURES": "X86_V4,AVX512_ICL,AVX512_SPR",
}
#: Set only where the machine has not set it (some machines set it for OpenBLAS's sake).
PINNED_UNLESS_SET = {"OPENBLAS_CORETYPE": "Haswell"}
#: Set to 1, the suite runs on the kernels each library picks for this CPU.
NATIVE = "PSS_TEST_NATIVE_KERNELS"


def pin(environ=os.environ) -> bool:
    """Pin ``environ`` to the one code path unless ``PSS_TEST_NATIVE_KERNELS`` is set;
    returns whether it did."""
    if environ.get(NATIVE):
        return False
    environ.update(PINNED)
    for name, value in PINNED_UNLESS_SET.items():
        environ.setdefault(name, value)
    return True


def fingerprints() -> dict[str, str]:
    """``{kernel: sha256 prefix of its output bits}`` for the kernels trained tests run:
    GEMMs of several shapes, a strided convolution and its gradients, attention, norms,
    activations, reductions, top-k, cross-entropy, fused Adam over a few steps of a small
    transformer layer, and numpy's BLAS and float64 maths. Two threads."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(2)

    def digest(value) -> str:
        array = value.detach().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
        return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()[:12]

    g = torch.Generator().manual_seed(0)
    out = {}
    a, b = torch.randn(257, 193, generator=g), torch.randn(193, 131, generator=g)
    out["gemm 257x193x131"] = digest(a @ b)
    out["gemm 512^3"] = digest(
        torch.randn(512, 512, generator=g) @ torch.randn(512, 512, generator=g)
    )
    w, bias = torch.randn(96, 193, generator=g), torch.randn(96, generator=g)
    out["linear"] = digest(F.linear(a, w, bias))
    out["bmm"] = digest(torch.randn(8, 17, 16, generator=g) @ torch.randn(8, 16, 17, generator=g))

    pixels = torch.randn(64, 3, 32, 32, generator=g, requires_grad=True)
    kernel = torch.randn(64, 3, 8, 8, generator=g, requires_grad=True)
    patches = F.conv2d(pixels, kernel, stride=8)
    patches.square().sum().backward()
    out["conv2d"], out["conv2d grad w"], out["conv2d grad x"] = map(
        digest, (patches, kernel.grad, pixels.grad)
    )

    z = torch.randn(300, 257, generator=g)
    for name, value in {
        "softmax": z.softmax(-1), "log_softmax": z.log_softmax(-1),
        "layer_norm": F.layer_norm(z, (257,)), "rms_norm": z * torch.rsqrt(z.square().mean(-1, keepdim=True) + 1e-6),
        "gelu": F.gelu(z), "gelu tanh": F.gelu(z, approximate="tanh"), "silu": F.silu(z),
        "exp": z.exp(), "log": z.abs().add(0.01).log(), "tanh": z.tanh(), "sigmoid": z.sigmoid(),
        "sum": z.sum(0), "mean": z.mean(), "norm": z.norm(dim=-1), "var": z.var(-1), "cumsum": z.cumsum(1),
        "topk": z.topk(5, -1).values, "cross_entropy": F.cross_entropy(z, torch.arange(300) % 257),
    }.items():  # fmt: skip
        out[name] = digest(value)

    q, k, v = (torch.randn(2, 4, 17, 16, generator=g, requires_grad=True) for _ in range(3))
    attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    attention.square().sum().backward()
    out["sdpa"], out["sdpa grad q"] = digest(attention), digest(q.grad)

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-3, fused=True)
    batch = torch.randn(16, 9, 64, generator=g)
    for _ in range(3):
        loss = layer(batch).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    out["transformer layer, 3 fused AdamW steps"] = digest(
        torch.cat([p.detach().flatten() for p in layer.parameters()])
    )

    x = np.random.default_rng(0).standard_normal((200, 150))
    x32 = x.astype(np.float32)
    for name, value in {
        "np gemm f32": x32 @ x32.T, "np gemm f64": x @ x.T, "np exp f64": np.exp(x),
        "np log f64": np.log(np.abs(x) + 0.01), "np pow f64": np.abs(x) ** 0.3, "np exp f32": np.exp(x32),
        "np sum f32": x32.sum(0), "np argsort": np.argsort(x32, axis=None, kind="stable"),
    }.items():  # fmt: skip
        out[name] = digest(value)
    return out


if __name__ == "__main__":
    if sys.argv[1:] == ["--pinned"]:
        pin()
    for name, value in fingerprints().items():
        print(f"{name}\t{value}")
