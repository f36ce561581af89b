"""Start a real `pagedllm serve` process on a free loopback port, and stop it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(
        self,
        model: str,
        *args: str,
        api_key: str | None = None,
        log_path: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        command = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", model, "--port", str(self.port), *args]
        if api_key:
            command += ["--api-key", api_key]
        self.log = open(log_path or os.devnull, "w")
        self.process = subprocess.Popen(
            command, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
        self._wait_ready(timeout=180)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError("server did not become ready")

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()
        return self.process.returncode


def kill_mid_stream(server: Server, kill) -> tuple[list[str], float]:
    """Open a long completion stream, call `kill()` once its first event has come, read the rest:
    the events after the first, and the seconds from `kill()` to the stream's end."""
    body = {"prompt": "Hello", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with (
        httpx.Client(base_url=server.url, timeout=60) as client,
        client.stream("POST", "/v1/completions", json=body) as response,
    ):
        lines = response.iter_lines()
        assert next(line for line in lines if line).startswith("data: {")
        kill()
        killed = time.monotonic()
        events = [line for line in lines if line]
    return events, time.monotonic() - killed
