"""The suite's pinned kernels (``tests/cpu_path.py``) give the same bits on other CPUs.

Another vendor's CPU is emulated by ``qemu-x86_64`` (Debian's ``qemu-user``, which
``./dev setup`` installs): an Intel Haswell (GenuineIntel, AVX2, no AVX-512, other cache
sizes) and an AMD EPYC-Rome (no AVX-512). The libraries read the emulated CPUID, so MKL
takes its Intel paths under the Haswell; an emulated CPU computes exact IEEE operations
as the hardware does (approximate ones, like ``rsqrt``, it computes in its own way, as
every vendor does: the pinned path must not depend on them, and this test would see it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cpu_path import NATIVE, PINNED

PROBE = Path(__file__).with_name("cpu_path.py")
QEMU = shutil.which("qemu-x86_64")
needs_qemu = pytest.mark.skipif(
    QEMU is None or os.uname().machine != "x86_64",
    reason="no qemu-x86_64 (Debian's qemu-user) to emulate other x86-64 CPUs",
)


def fingerprints(*prefix: str, pinned: bool = True) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in PINNED and k != NATIVE}
    env |= PINNED if pinned else {NATIVE: "1"}
    run = subprocess.run([*prefix, sys.executable, str(PROBE)], env=env, capture_output=True,
                         text=True, check=True, timeout=600)  # fmt: skip
    return dict(line.split("\t") for line in run.stdout.splitlines())


@pytest.fixture(scope="module")
def here():
    return fingerprints()


@needs_qemu
@pytest.mark.parametrize("cpu", ["Haswell-v4", "EPYC-Rome"])
def test_the_pinned_path_is_the_same_bits_on_another_cpu(here, cpu):
    there = fingerprints(QEMU, "-cpu", cpu)
    assert len(here) > 30
    assert {k: there[k] for k in here if there[k] != here[k]} == {}


def test_the_probe_sees_the_kernels_it_pins(here):
    """Without the pins MKL takes its own path for this CPU (AVX2 or AVX-512 on an Intel
    one, its non-Intel path on an AMD one): other GEMM bits (so the test above could fail)."""
    native = fingerprints(pinned=False)
    assert native["gemm 512^3"] != here["gemm 512^3"]


@pytest.mark.skipif(bool(os.environ.get(NATIVE)), reason=f"{NATIVE} is set")
def test_the_suites_own_processes_run_the_pinned_path():
    """conftest pins the environment before anything imports numpy or torch (zarr's
    pytest plugin, which imports numpy, is off)."""
    import numpy as np
    import torch

    assert torch.backends.cpu.get_cpu_capability() == "AVX2"
    assert not np._core._multiarray_umath.__cpu_features__["X86_V4"]
