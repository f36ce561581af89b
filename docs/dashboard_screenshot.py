"""Take docs/dashboard.png: `pagedllm serve` on the default model under a mixed load (a shared
system prompt, parallel samples, requests queued past --max-num-seqs), its /dashboard in headless
Chromium after a few seconds.

    python docs/dashboard_screenshot.py [--out docs/dashboard.png]
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import httpx
from playwright.sync_api import sync_playwright

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from server_utils import Server  # noqa: E402

SYSTEM = "You are a careful assistant. Answer in plain words, in a few sentences, and say when you are unsure. "
QUESTIONS = ["Why is the sky blue?", "How do bees make honey?", "What is a prime number?", "Why do cats purr?",
             "How does a bicycle stay upright?", "What makes bread rise?", "Why is the sea salty?",
             "How do vaccines work?", "What is inflation?", "Why do leaves change colour?"]


def load(url: str) -> list[threading.Thread]:
    def one(i: int) -> None:
        body = {"prompt": SYSTEM * 3 + QUESTIONS[i % len(QUESTIONS)], "max_tokens": 150 + 40 * (i % 4),
                "ignore_eos": True, "n": 3 if i % 5 == 0 else 1, "temperature": 0.8}
        httpx.post(f"{url}/v1/completions", json=body, timeout=600)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(20)]
    for thread in threads:
        thread.start()
        time.sleep(0.3)
    return threads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "dashboard.png"))
    args = parser.parse_args()
    from conftest import default_model_dir  # noqa: E402 - the tests' lookup of the default model

    model = os.path.join(default_model_dir(), "SmolLM2-135M-Instruct.Q4_1.gguf")
    server = Server(model, "--max-num-seqs", "16", "--kv-cache-memory", "96MiB", "--max-model-len", "1024")
    try:
        threads = load(server.url)
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path="/usr/bin/chromium", args=[
                "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update"])
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            page.goto(f"{server.url}/dashboard")
            page.wait_for_function("Number(document.body.dataset.updates) >= 5", timeout=60_000)
            cell = page.query_selector(".grid .cell.s")
            if cell is not None:
                cell.hover()
            page.screenshot(path=args.out, full_page=True)
            browser.close()
        for thread in threads:
            thread.join()
    finally:
        server.stop()


if __name__ == "__main__":
    main()
