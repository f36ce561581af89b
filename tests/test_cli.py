"""`pagedllm generate` end to end in a subprocess."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pagedllm.entrypoints.cli", *args], capture_output=True, text=True, timeout=300
    )


def test_generate_prints_completion(llama_dir):
    result = _cli("generate", "Hello world", "--model", llama_dir, "--max-tokens", "5", "--kv-cache-memory", "16MiB")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Hello world") and len(result.stdout.strip()) > len("Hello world")
    assert "KV cache:" in result.stderr


def test_generate_reports_bad_model_clearly(tmp_path):
    result = _cli("generate", "hi", "--model", str(tmp_path / "nope"))
    assert result.returncode == 2 and "does not exist" in result.stderr


def test_a_checkpoint_method_on_an_unquantized_folder_fails_at_start_up(llama_dir):
    result = _cli("generate", "hi", "--model", llama_dir, "--quantization", "gptq")
    assert result.returncode == 2 and "needs a checkpoint quantized by it" in result.stderr, result.stderr


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
        (["--tool-call-parser", "nope"], "invalid choice: 'nope'"),
        (["--reasoning-parser", "nope"], "invalid choice: 'nope'"),
        (["--chat-template", "/nonexistent/template.jinja"], "cannot read the chat template"),
        (["--speculative-config", '{"method": "nope", "num_speculative_tokens": 2}'], "unknown method 'nope'"),
        (["--speculative-config", "{not json"], "not JSON"),
        (["--long-prefill-token-threshold", "-1"], "long_prefill_token_threshold must be a finite number >= 0"),
        (["--long-prefill-token-threshold", "nan"], "long_prefill_token_threshold must be a finite number >= 0"),
        (["--limit-mm-per-prompt", '{"image": -1}'], 'limit_mm_per_prompt takes {"image": N} with N >= 0'),
        (["--limit-mm-per-prompt", '{"audio": 1}'], 'limit_mm_per_prompt takes {"image": N} with N >= 0'),
        (["--limit-mm-per-prompt", "image=2"], "not JSON"),
        (["--mm-encoder-cache-tokens", "0"], "mm_encoder_cache_tokens must be >= 1"),
        (["--gpu-memory-utilization", "0.5"], "gpu_memory_utilization sizes the KV cache on a GPU"),
        (["--device", "cuda", "--gpu-memory-utilization", "1.5"], "gpu_memory_utilization must be in (0, 1]"),
        (["--device", "cuda", "--gpu-memory-utilization", "0"], "gpu_memory_utilization must be in (0, 1]"),
        (
            ["--device", "cuda", "--gpu-memory-utilization", "0.5", "--kv-cache-memory", "1GiB"],
            "not both",
        ),
        (["--gpu-memory-utilization", "high"], "invalid float value"),
    ],
)
def test_serve_refuses_bad_chat_flags_before_loading(flags, message):
    result = _cli("serve", "/nonexistent/model", "--port", "0", *flags)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert "KV cache:" not in result.stderr


def test_bench_throughput_and_latency_offline(llama_dir, tmp_path, capsys):
    """`pagedllm bench throughput|latency` in this process: their JSON agrees with what they print
    and with the workload asked for."""
    import json
    import logging

    from pagedllm.entrypoints.cli import main

    level = logging.getLogger("pagedllm").level
    engine = ["--model", llama_dir, "--kv-cache-memory", "16MiB", "--max-model-len", "256", "--disable-tqdm"]
    assert (
        main(
            [
                "bench",
                "throughput",
                *engine,
                "--num-prompts",
                "6",
                "--input-len",
                "20",
                "--output-len",
                "7",
                "--output-json",
                str(tmp_path / "t.json"),
            ]
        )
        == 0
    )
    result = json.loads((tmp_path / "t.json").read_text())
    assert result["requests"] == 6 and result["total_num_tokens"] == 6 * (20 + 7)
    assert f"{result['output_tokens_per_second']:.1f} output tokens/s" in capsys.readouterr().out
    assert (
        main(
            [
                "bench",
                "latency",
                *engine,
                "--batch-size",
                "2",
                "--output-len",
                "5",
                "--num-iters",
                "3",
                "--num-iters-warmup",
                "1",
                "--output-json",
                str(tmp_path / "l.json"),
            ]
        )
        == 0
    )
    result = json.loads((tmp_path / "l.json").read_text())
    assert len(result["latencies"]) == 3 and result["percentiles"]["50"] == sorted(result["latencies"])[1]
    assert f"Avg latency: {result['avg_latency']:.4f} seconds" in capsys.readouterr().out
    assert logging.getLogger("pagedllm").level == level  # (quiet while it ran, as it was after)


def test_bench_serve_says_when_no_server_answers(capsys):
    from pagedllm.entrypoints.cli import main
    from server_utils import free_port

    port = free_port()  # (nothing listens there)
    assert main(["bench", "serve", "--port", str(port), "--num-prompts", "1", "--disable-tqdm"]) == 2
    assert f"cannot reach the server at http://127.0.0.1:{port}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "serve", "--num-prompts", "0"])
    assert "--num-prompts: 0 must be > 0" in capsys.readouterr().err
