"""The GPU check's script (benchmarks/gpu_check.py, which checks/gpu/run.sh runs on a lent GPU),
kept working on the CPU: its tiny run makes its models, holds four families' greedy tokens to
transformers', checks batch invariance, times both engines, and writes every field it reports."""

from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "gpu_check.py")


def test_the_gpu_check_runs_on_the_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    done = subprocess.run(
        [sys.executable, SCRIPT, "--device", "cpu", "--smoke", "--rounds", "1", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert {arch: r["equal"] for arch, r in report["oracle"].items()} == dict.fromkeys(
        ["llama", "mistral", "qwen3", "gemma2"], True
    )
    assert all(len(r["ours"][0]) == 16 for r in report["oracle"].values())
    assert report["invariance"]["batch_equals_alone"] and report["invariance"]["graphs_equal_eager"]
    tiny = report["throughput"]["tiny"]
    assert set(tiny["ratio_vs_transformers"]) == {"1", "8", "32", "64"}
    assert tiny["batch1"]["seconds_a_token"] > 0 and tiny["batch1"]["copy_bytes_per_s"] > 0
