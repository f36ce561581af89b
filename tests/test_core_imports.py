"""The core (scheduler, KV cache manager, requests, step messages) is pure Python: importing it
does not import torch, so it can run where torch is not loaded (another process, its own tests)."""

from __future__ import annotations

import subprocess
import sys

import pytest


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


def test_the_offline_engine_runs_without_the_servers_dependencies(tmp_path, tokenizer_dir):
    """The GPU check's machine has none of FastAPI, uvicorn, pydantic, xgrammar, gguf,
    prometheus-client, psutil, LMDB, Pillow or aiohttp (issue 51): LLM imports and generates there
    (each one made unimportable), given --kv-cache-memory in bytes (a share needs psutil)."""
    from conftest import make_model

    folder = make_model("llama", tmp_path, tokenizer_dir)
    absent = ["fastapi", "uvicorn", "starlette", "pydantic", "xgrammar", "gguf", "prometheus_client"]
    absent += ["psutil", "lmdb", "PIL", "aiohttp", "httpx"]
    code = (
        f"import sys; sys.modules.update(dict.fromkeys({absent!r}))\n"
        "from pagedllm import LLM, SamplingParams\n"
        f"llm = LLM({folder!r}, kv_cache_memory='16MiB')\n"
        "out = llm.generate([{'prompt_token_ids': [5, 6, 7]}], SamplingParams(max_tokens=3), use_tqdm=False)\n"
        "print(len(out[0].outputs[0].token_ids), sorted(m for m in " + repr(absent) + " if sys.modules.get(m)))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[-2] == "3 []", done.stdout


def test_a_memory_size_in_bytes_asks_nothing_of_the_machine():
    """--kv-cache-memory in bytes needs no psutil; a fraction or the default asks for the memory."""
    from pagedllm.config import parse_memory

    def unasked() -> int:
        raise AssertionError("the available memory was asked for")

    assert parse_memory("16MiB", unasked) == 16 << 20 and parse_memory(4096, unasked) == 4096
    assert parse_memory("0.5", lambda: 1000) == 500 and parse_memory(0.25, lambda: 1000) == 250
    assert parse_memory(None, lambda: 4 << 30) == 1 << 30
    with pytest.raises(ValueError, match="cannot read a memory size"):
        parse_memory("lots", unasked)
