"""The core (scheduler, KV cache manager, requests, step messages) is pure Python: importing it
does not import torch, so it can run where torch is not loaded (another process, its own tests)."""

from __future__ import annotations

import subprocess
import sys


def test_the_core_imports_without_torch():
    code = (
        "import sys; import pagedllm.core.scheduler, pagedllm.core.kv_cache_manager, pagedllm.core.step; "
        "from pagedllm import SamplingParams, EngineArgs; "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout


def test_llm_is_still_importable_from_the_package():
    from pagedllm import LLM
    from pagedllm.entrypoints.llm import LLM as Direct

    assert LLM is Direct
