"""--compile: torch.compile for the elementwise work that no C++ kernel takes.

Where the kernels run (bf16 or fp32 on CPU), RMSNorm with its residual add, SiLU-and-mul and
rotary are one fused pass each already, and --compile changes nothing there. Elsewhere (another
device, another dtype, PAGEDLLM_NO_KERNELS=1) each is a chain of torch ops; compiled, Inductor
fuses each chain into one kernel. On this CPU with the kernels off it measured level at 8-32
requests (attention's torch path dominates there) and slower at one, where a compiled function's
guards take longer than the few ops they replace (docs/benchmarks-history.md); so it is opt-in.

It swaps module functions, so it holds for the whole process once any engine asks for it.
"""

from __future__ import annotations

import logging

import torch

from pagedllm.layers import activation, attention, norm

logger = logging.getLogger(__name__)

# (module, name): where each torch path is looked up when it is called.
TORCH_PATHS = (
    (norm, "rms_norm_reference"),
    (norm, "add_rms_norm_reference"),
    (activation, "silu_and_mul_reference"),
    (attention, "apply_rotary"),
)


def compile_torch_paths() -> None:
    """Swap each torch path for its compiled form (once per process; compiled on first call for
    each new shape class, a few seconds each)."""
    for module, name in TORCH_PATHS:
        fn = getattr(module, name)
        if not is_compiled(fn):
            setattr(module, name, torch.compile(fn, dynamic=True))
    logger.info("--compile: the torch paths of RMSNorm, SiLU-and-mul and rotary compile on first use")


def is_compiled(fn) -> bool:
    return hasattr(fn, "_torchdynamo_orig_callable")
