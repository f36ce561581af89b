"""C++ CPU kernels, compiled on first use and cached; each has a pure-torch reference in layers/."""
from __future__ import annotations

import functools
import logging
import os
from types import ModuleType

import torch

logger = logging.getLogger(__name__)
_DIR = os.path.dirname(__file__)


@functools.cache
def cpu_ops() -> ModuleType | None:
    """The compiled module, or None (with a warning) where no compiler or toolchain is at hand."""
    if os.environ.get("PAGEDLLM_NO_KERNELS") == "1":
        return None
    try:
        from torch.utils.cpp_extension import load

        logger.info("Loading the C++ kernels (built and cached on first use: about 35 s)")
        return load(
            name="pagedllm_cpu_ops",
            sources=[os.path.join(_DIR, f) for f in ("paged_attention.cpp", "fused_ops.cpp", "packed_linear.cpp",
                                                     "decoder_stack.cpp")],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # noqa: BLE001 - any build failure means: use the torch path
        logger.warning("C++ kernels unavailable (%s); using the pure-torch attention", exc)
        return None


def fused_ops_for(x: torch.Tensor) -> ModuleType | None:
    """The compiled module where its elementwise kernels take x (fp32 or bf16 on the CPU), else None."""
    return cpu_ops() if x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) else None
