"""The kernels' AVX2 path, which CPUs without AVX-512 take: built here for x86-64-v3
($PAGEDLLM_KERNEL_MARCH) and put through the kernel and quantized-model tests in a child process
(the build and its module are per process)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pagedllm.kernels import kernels_expected

pytestmark = [pytest.mark.slow, pytest.mark.skipif(kernels_expected() is not None, reason="kernels cannot build here")]
TESTS = os.path.dirname(__file__)
KERNEL_TESTS = [
    "test_quant_kernels.py",
    "test_paged_attention_kernel.py",
    "test_fused_ops.py",
    "test_linear.py",
    "test_decoder_stack.py",
    "test_kv_cache_fp8.py",
    "test_gguf_quantized.py",
    "test_lora.py",
]


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return set(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))


def _cpu_has_avx2() -> bool:
    return {"avx2", "fma", "f16c"} <= _cpu_flags()


@pytest.mark.skipif(not _cpu_has_avx2(), reason="this CPU cannot run AVX2 code")
@pytest.mark.skipif("avx512f" not in _cpu_flags(), reason="without AVX-512 the native build is the AVX2 path: tested")
def test_the_avx2_build_passes_the_kernel_tests():
    env = {**os.environ, "PAGEDLLM_KERNEL_MARCH": "x86-64-v3"}
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "from pagedllm.kernels import cpu_ops; o = cpu_ops(); "
            "print(o.quant_linear_simd(), o.packed_linear_available())",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    assert probe.stdout.split() == ["avx2", "False"], probe.stdout + probe.stderr  # no AVX-512 in the build
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-x",
            *(os.path.join(TESTS, name) for name in KERNEL_TESTS),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=os.path.dirname(TESTS),
    )
    print(run.stdout[-3000:])
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
