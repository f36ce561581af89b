"""The live dashboard: the core's snapshot against its pool, and the page in a real browser
(headless Chromium, Debian's package, driven by Playwright) against /metrics while requests run."""

from __future__ import annotations

import os
import re
import shutil
import threading

import httpx
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.core.snapshot import CACHED, FREE, HELD, SHARED
from server_utils import Server

KEY = "dash-key"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# CI installs Chromium (.ci/run); elsewhere the browser test needs it installed (apt-get install chromium).
needs_browser = pytest.mark.skipif(
    CHROMIUM is None and not os.environ.get("CI"), reason="Chromium is not installed (apt-get install chromium)"
)


def _check_snapshot(snapshot) -> None:
    """Every block's state agrees with the tables that hold it and with the stats of the same instant."""
    holders: dict[int, int] = {}
    for view in snapshot.requests:
        for block in view.blocks:
            holders[block] = holders.get(block, 0) + 1
    for block, state in enumerate(snapshot.blocks):
        count = holders.get(block, 0)
        assert state == (SHARED if count > 1 else HELD if count == 1 else state), (block, state, count)
        if count == 0:
            assert state in (FREE, CACHED)
    stats = snapshot.stats
    assert snapshot.blocks.count(FREE) + snapshot.blocks.count(CACHED) == stats.kv_blocks_free
    assert len(snapshot.blocks) == stats.kv_blocks_total
    assert sum(v.status == "running" for v in snapshot.requests) == stats.num_running
    assert sum(v.status in ("waiting", "preempted") for v in snapshot.requests) == stats.num_waiting


def test_snapshots_agree_with_the_pool_through_sharing_preemption_and_release(llama_dir):
    """Samples sharing a prompt, a pool small enough to preempt, then everything released."""
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory="256KiB", max_model_len=256, block_size=16)
    engine = llm.engine
    prefix = list(range(100, 164))
    engine.add_request(
        "shared", prefix + [7], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=40, ignore_eos=True)
    )
    for i in range(6):
        engine.add_request(
            f"r{i}", prefix + [200 + i] * 20, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
        )
    seen = set()
    while engine.has_unfinished_requests():
        engine.step()
        engine.request_snapshot()
        (snapshot,) = engine.take_snapshots()
        _check_snapshot(snapshot)
        seen.update(snapshot.blocks)
        seen.update(v.status for v in snapshot.requests)
    assert {SHARED, HELD, "running", "waiting", "preempted"} <= seen
    engine.request_snapshot()
    (idle,) = engine.take_snapshots()
    _check_snapshot(idle)
    assert idle.requests == [] and CACHED in idle.blocks and set(idle.blocks) <= {FREE, CACHED}
    steps = idle.steps
    assert [s.index for s in steps] == list(range(steps[0].index, steps[0].index + len(steps)))
    assert sum(s.preemptions for s in steps) == idle.stats.num_preemptions > 0
    assert all(s.prefill_tokens + s.decode_tokens > 0 and s.batch_size > 0 for s in steps)


def _metric(text: str, name: str) -> float:
    return float(re.search(rf'^pagedllm:{name}{{[^}}]*engine="0"[^}}]*}} (\S+)$', text, re.M).group(1))


def _rendered(page) -> dict:
    """What the page shows: its grid's cells by state, its request rows by state, its hit rate."""
    return page.evaluate("""() => {
        const cells = [...document.querySelectorAll('.grid[data-replica="0"] .cell')];
        const count = (k) => cells.filter((c) => c.classList.contains(k)).length;
        const rows = [...document.querySelectorAll('#queue tr.req')];
        return {f: count('f'), c: count('c'), h: count('h'), s: count('s'), cells: cells.length,
                running: rows.filter((r) => r.classList.contains('running')).length,
                waiting: rows.filter((r) => !r.classList.contains('running') && !r.classList.contains('held')).length,
                shownRunning: Number(document.getElementById('running').textContent),
                hitRate: document.getElementById('hit-rate').textContent};
    }""")


def _agrees_with_metrics(page, server: Server) -> dict | None:
    """The rendered page against /metrics, scraped between two refreshes that show the same counts
    (the pool and the queues did not change in between); None if they changed."""
    page.evaluate("window.dashboard.refresh()")
    before = _rendered(page)
    metrics = httpx.get(f"{server.url}/metrics").text
    page.evaluate("window.dashboard.refresh()")
    if _rendered(page) != before:
        return None
    free = _metric(metrics, "kv_cache_free_blocks")
    assert before["f"] + before["c"] == free
    assert before["h"] + before["s"] == before["cells"] - free
    assert abs(_metric(metrics, "kv_cache_usage_perc") - (before["h"] + before["s"]) / before["cells"]) < 1e-9
    assert before["running"] == before["shownRunning"] == _metric(metrics, "num_requests_running")
    assert before["waiting"] == _metric(metrics, "num_requests_waiting")
    hits, queries = _metric(metrics, "prefix_cache_hits_total"), _metric(metrics, "prefix_cache_queries_total")
    assert before["hitRate"] == f"{100 * hits / queries:.1f}%"
    return before


@needs_browser
def test_the_page_in_chromium_shows_what_metrics_says(llama_dir, tmp_path):
    from playwright.sync_api import sync_playwright

    # 200 ms more a step: requests stay in flight while the page is read.
    server = Server(
        llama_dir,
        "--max-model-len",
        "256",
        "--kv-cache-memory",
        "1MiB",
        "--dtype",
        "float32",
        "--max-num-seqs",
        "6",
        # Its 35-token prompts are long beside 256 (LONG_PROMPT_SHARE): unheld, all six run at once.
        "--long-prefill-token-threshold",
        "0",
        api_key=KEY,
        env={"PAGEDLLM_FAULT": "slow:200"},
        log_path=str(tmp_path / "server.log"),
    )
    headers = {"Authorization": f"Bearer {KEY}"}
    try:
        assert httpx.get(f"{server.url}/dashboard").status_code == 200  # the page holds no data
        assert httpx.get(f"{server.url}/dashboard/state").status_code == 401
        prompt = "A shared system prompt, long enough to fill a block or two of the cache: " * 2

        def complete(i: int) -> None:
            httpx.post(
                f"{server.url}/v1/completions",
                headers=headers,
                timeout=120,
                json={"prompt": prompt + str(i), "max_tokens": 96 if i < 6 else 8, "ignore_eos": True},
            )

        load = [threading.Thread(target=complete, args=(i,)) for i in range(8)]
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(
                executable_path=CHROMIUM,
                args=["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update"],
            )
            page = browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda error: errors.append(str(error)))
            page.goto(f"{server.url}/dashboard")
            page.wait_for_selector("#keyform form", state="visible")  # no key yet: the page asks for it
            page.fill("#key", KEY)
            page.click("#keyform button")
            # The load starts only now: a slow browser start must not let it end unseen.
            for thread in load:
                thread.start()
            # 8 requests, 6 run at most: two wait (rows of their own) until the first end.
            # Wait for both: just after they arrive, all eight wait.
            page.wait_for_selector("#queue tr.req.waiting", timeout=30_000)
            page.wait_for_selector("#queue tr.req.running", timeout=30_000)
            # While the load runs the counts change often: read until a quiet moment with requests running.
            busy = next(s for s in (_agrees_with_metrics(page, server) for _ in range(40)) if s and s["running"])
            assert busy["h"] + busy["s"] > 0, busy
            # A shared block (the prompts' common prefix) names the requests holding it.
            page.hover('.grid[data-replica="0"] .cell.s', timeout=10_000)
            tip = page.inner_text("#tip")
            owners = page.evaluate("[...document.querySelectorAll('#queue tr.running')].map((r) => r.dataset.id)")
            assert "shared by" in tip and any(owner in tip for owner in owners)
            for thread in load:
                thread.join()
            page.wait_for_function("Number(document.getElementById('running').textContent) === 0", timeout=30_000)
            idle = next(filter(None, (_agrees_with_metrics(page, server) for _ in range(10))))
            assert idle["c"] > 0 and idle["h"] == idle["s"] == 0  # finished prompts stay cached
            steps = page.evaluate("window.lastState.replicas[0].steps")
            assert sum(s["decode_tokens"] for s in steps) > 0 and sum(s["prefill_tokens"] for s in steps) > 0
            # A pool past MAX_CELLS blocks: a cell for several, the busiest state showing, counts whole.
            big = page.evaluate("""() => {
                const snap = {...window.lastState.replicas[0], requests: [],
                              blocks: 'f'.repeat(39990) + 'c'.repeat(5) + 's'.repeat(5)};
                drawPool(7, snap);
                const grid = document.querySelector('.grid[data-replica="7"]');
                const section = grid.closest('section');
                return {cells: grid.children.length, last: grid.lastElementChild.className,
                        s: section.querySelector('.count-s').textContent,
                        f: section.querySelector('.count-f').textContent};
            }""")
            assert big == {"cells": 13334, "last": "cell s", "s": "5", "f": "39990"}
            assert errors == []
            browser.close()
    finally:
        status = server.stop()
    assert status in (0, -15)
