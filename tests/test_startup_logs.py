"""Startup lines reach a non-terminal stderr (a server log) once each, with no progress-bar redraws."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

from pagedllm.logger import LOGGER_NAME, configure_logging


def _run(args: list[str], **env: str) -> tuple[int, bytes]:
    """(exit status, stderr as bytes): text mode would turn a '\\r' into '\\n' and hide it."""
    environ = {k: v for k, v in os.environ.items() if k != "PAGEDLLM_NO_PROGRESS"}  # conftest sets it
    environ.update(env)
    result = subprocess.run(
        [sys.executable, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=environ, timeout=300
    )
    return result.returncode, result.stderr


def test_offline_llm_logs_kv_cache_once_and_no_carriage_returns(llama_dir):
    code = f"from pagedllm import LLM; LLM({llama_dir!r}, dtype='float32', kv_cache_memory='32MiB')"
    status, stderr = _run(["-c", code])
    assert status == 0, stderr.decode()
    text = stderr.decode()
    assert text.count("KV cache:") == 1, text
    assert b"\r" not in stderr
    assert "Loading weights" in text and "Loaded " in text, text  # plain lines in place of the bar
    assert "Model: LlamaForCausalLM (llama), Hugging Face folder, quantization none" in text, text


def test_speculative_decoding_is_announced_at_start_up(llama_dir):
    config = "{'method': 'ngram', 'num_speculative_tokens': 3}"
    code = (
        f"from pagedllm import LLM; "
        f"LLM({llama_dir!r}, dtype='float32', kv_cache_memory='32MiB', speculative_config={config})"
    )
    status, stderr = _run(["-c", code])
    assert status == 0, stderr.decode()
    assert "Speculative decoding: ngram, up to 3 draft tokens a step" in stderr.decode(), stderr.decode()
    status, stderr = _run(
        ["-c", f"from pagedllm import LLM; LLM({llama_dir!r}, dtype='float32', kv_cache_memory='32MiB')"]
    )
    assert status == 0 and b"Speculative decoding" not in stderr


def test_cli_prints_each_line_once_beside_its_basic_config(llama_dir):
    status, stderr = _run(
        [
            "-m",
            "pagedllm.entrypoints.cli",
            "generate",
            "Hi",
            "--model",
            llama_dir,
            "--max-tokens",
            "2",
            "--kv-cache-memory",
            "16MiB",
        ]
    )
    assert status == 0, stderr.decode()
    assert stderr.decode().count("KV cache:") == 1
    assert b"\r" not in stderr


def _ours(logger: logging.Logger) -> list[logging.Handler]:
    # pytest may hang its own capture handlers on the logger too
    return [h for h in logger.handlers if type(h).__module__ == "pagedllm.logger"]


def test_configure_logging_is_idempotent():
    logger = logging.getLogger(LOGGER_NAME)
    before = _ours(logger)
    configure_logging()
    assert _ours(logger) == before and len(before) == 1 and not logger.propagate


def test_configure_logging_can_be_turned_off():
    code = (
        "import logging, pagedllm; logger = logging.getLogger('pagedllm'); "
        "assert not logger.handlers and logger.propagate, logger.handlers"
    )  # no pytest in the child
    status, stderr = _run(["-c", code], PAGEDLLM_CONFIGURE_LOGGING="0")
    assert status == 0, stderr.decode()
