"""`pagedllm generate` end to end in a subprocess."""
from __future__ import annotations

import subprocess
import sys

import pytest


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", *args], capture_output=True,
                          text=True, timeout=300)


def test_generate_prints_completion(llama_dir):
    result = _cli("generate", "Hello world", "--model", llama_dir, "--max-tokens", "5", "--kv-cache-memory", "16MiB")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Hello world") and len(result.stdout.strip()) > len("Hello world")
    assert "KV cache:" in result.stderr


def test_generate_reports_bad_model_clearly(tmp_path):
    result = _cli("generate", "hi", "--model", str(tmp_path / "nope"))
    assert result.returncode == 2 and "does not exist" in result.stderr


@pytest.mark.parametrize("flags, message", [
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
    (["--tool-call-parser", "nope"], "invalid choice: 'nope'"),
    (["--reasoning-parser", "nope"], "invalid choice: 'nope'"),
    (["--chat-template", "/nonexistent/template.jinja"], "cannot read the chat template"),
    (["--speculative-config", '{"method": "nope", "num_speculative_tokens": 2}'], "unknown method 'nope'"),
    (["--speculative-config", "{not json"], "not JSON"),
])
def test_serve_refuses_bad_chat_flags_before_loading(flags, message):
    result = _cli("serve", "/nonexistent/model", "--port", "0", *flags)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert "KV cache:" not in result.stderr
