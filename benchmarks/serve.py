"""Serving benchmark for any OpenAI-compatible server: `pagedllm bench serve` (pagedllm/benchmarks/serve.py,
which says what it measures), with two things more for this repository's figures:

    python benchmarks/serve.py --num-prompts 64 --input-len 128 --output-len 128 --launch [serve flags]

--launch starts `pagedllm serve` itself (default model) on a free port and stops it after, and
reports the server's resident memory (its RSS once ready, and the most it reached during the run,
sampled every 0.2 s); --dataset grounded sends the input-grounded chats of
benchmarks/data/grounded_tasks.json (editing, quoting) in turn, ending where they end.
Random prompts here ask the server to ignore EOS (every request generates --output-len tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request

from pagedllm.benchmarks import serve

GROUNDED = os.path.join(os.path.dirname(__file__), "data", "grounded_tasks.json")


def launch(extra: list[str]) -> tuple[subprocess.Popen, str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen(
        [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--port", str(port), *extra],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1):
                return process, url
        except OSError:
            time.sleep(0.5)
    process.kill()
    raise RuntimeError("server did not start")


class RssPeak:
    """The resident memory of a process: at start, and the most seen, sampled on a thread."""

    def __init__(self, pid: int, interval: float = 0.2) -> None:
        import threading

        import psutil

        self.process, self.interval = psutil.Process(pid), interval
        self.ready = self.peak = self.process.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.peak = max(self.peak, self.process.memory_info().rss)
            except Exception:  # noqa: BLE001 - the server has exited
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    serve.add_cli_args(parser)
    parser.set_defaults(ignore_eos=True)
    parser.add_argument("--grounded", action="store_true", help="the chats of benchmarks/data/grounded_tasks.json")
    parser.add_argument(
        "--launch",
        nargs=argparse.REMAINDER,
        default=None,
        help="start `pagedllm serve` with these arguments instead of using --base-url",
    )
    argv = [a for arg in sys.argv[1:] for a in (["--grounded"] if arg == "--dataset=grounded" else [arg])]
    for i, arg in enumerate(argv[:-1]):  # the older spelling, --dataset grounded
        if arg == "--dataset" and argv[i + 1] == "grounded":
            argv[i : i + 2] = ["--grounded"]
            break
    args = parser.parse_args(argv)
    out, args.result_filename, args.save_result = args.result_filename, None, False  # written below, RSS included
    requests = None
    if args.grounded:
        with open(GROUNDED) as f:
            tasks = json.load(f)
        args.backend = "openai-chat"
        requests = [
            ([{"role": "user", "content": f"{t['task']}\n\n{t['text']}"}], args.random_output_len)
            for t in (tasks[i % len(tasks)] for i in range(args.num_prompts))
        ]
        args.ignore_eos = False
    process, sampler = None, None
    if args.launch is not None:
        process, args.base_url = launch(args.launch)
        sampler = RssPeak(process.pid)
    try:
        result = serve.main(args, requests)
    finally:
        if process is not None:
            sampler.stop()
            process.terminate()
            process.wait(timeout=60)
    if sampler is not None:
        result["rss_ready_mib"], result["rss_peak_mib"] = sampler.ready / 2**20, sampler.peak / 2**20
        print(f"server RSS: {sampler.ready / 2**20:.0f} MiB once ready, {sampler.peak / 2**20:.0f} MiB at most")
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=2)
    r = result
    print(
        "| requests | rate | req/s | output tok/s | TTFT mean/median/p99 ms | TPOT median ms | "
        "ITL median ms | E2E median s | /health median/max ms | client CPU s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    print(
        f"| {r['requests']} | {args.request_rate} | {r['request_throughput']:.2f} | {r['output_throughput']:.1f} | "
        f"{r['ttft']['mean_ms']:.0f}/{r['ttft']['median_ms']:.0f}/{r['ttft']['p99_ms']:.0f} | "
        f"{r['tpot']['median_ms']:.1f} | {r['itl']['median_ms']:.1f} | {r['e2e']['median_ms'] / 1000:.2f} | "
        f"{r['health']['median_ms']:.1f}/{r['health_max_ms']:.1f} | {r['client_cpu_s']:.2f} |"
    )


if __name__ == "__main__":
    main()
