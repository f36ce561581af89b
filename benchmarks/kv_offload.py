"""The KV cache's disk tier (--kv-offload-dir) against recomputing, three ways.

    .venv/bin/python benchmarks/kv_offload.py ttft --runs 3                       # the default model
    .venv/bin/python benchmarks/kv_offload.py ttft --runs 3 --drop-caches
    .venv/bin/python benchmarks/kv_offload.py ttft --runs 3 --model /tmp/llama-250m-8k
    .venv/bin/python benchmarks/kv_offload.py docs --runs 3
    .venv/bin/python benchmarks/kv_offload.py preempt --runs 3

ttft: a --doc-tokens document prompt (random token ids) and a short question. A first process
writes the document's blocks to a fresh store and exits; then (after `echo 3 >
/proc/sys/vm/drop_caches` with --drop-caches: the store read from the disk, not the page cache) a
second process, the restart, times the first token of the document with another question: once
with the store (the document's blocks read back) and once without it (an engine of its own,
everything computed). Each engine first answers a short warm-up prompt. Ratio: recompute / store.

docs: --docs distinct --doc-tokens documents whose K/V together are 4x the KV cache's budget;
--requests requests cycle through them, each the document and a question of its own (max_tokens
--max-tokens), submitted at once. With the store, a first pass over the documents (not timed)
writes them; without it, memory holds a quarter and the cycle misses every time. Figure: requests
per second of the timed pass, store / none.

preempt: --seqs requests of --prompt-tokens prompt and --output-tokens output at once, the KV
budget a quarter of what they need together: preemptions. Output tokens per second with the store
(a preempted request's full blocks read back when memory no longer holds them) / without.

Every figure is the median over --runs runs, with the spread (min-max); the arms of a run
alternate which goes first. --busy N runs N busy processes (`while True: pass`) beside the whole
measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _tokens(seed: int, n: int, vocab: int = 30000) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(100, vocab) for _ in range(n)]


def _llm(args: argparse.Namespace, store: str | None, kv_memory: str | int | None = None):
    from pagedllm import LLM

    return LLM(
        args.model,
        max_model_len=args.max_model_len,
        kv_cache_memory=kv_memory or args.kv_cache_memory,
        kv_offload_dir=store,
        kv_offload_size=args.kv_offload_size,
    )


def _generate(llm, prompts: list[list[int]], max_tokens: int) -> float:
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start


def _warm(llm) -> None:
    _generate(llm, [_tokens(99, 64)], 4)


# -- the children: one engine's part, figures as a JSON line ------------------------------------------
def child_fill(args: argparse.Namespace) -> dict:
    llm = _llm(args, args.store)
    _generate(llm, [_tokens(1, args.doc_tokens) + _tokens(2, 16)], 1)
    llm.engine.shutdown()
    return {}


def child_ttft(args: argparse.Namespace) -> dict:
    prompt = _tokens(1, args.doc_tokens) + _tokens(3, 16)  # the document, another question
    times = {}
    for arm in ["store", "none"] if args.order == 0 else ["none", "store"]:
        llm = _llm(args, args.store if arm == "store" else None)
        _warm(llm)
        times[arm] = _generate(llm, [prompt], 1)
        stats = llm.engine.stats()
        if arm == "store":
            times["hit_blocks"] = stats.kv_tier_hits
        llm.engine.shutdown()
    return times


def _doc_kv_budget(args: argparse.Namespace) -> int:
    """A quarter of the documents' K/V, from the engine's bytes a block."""
    from pagedllm.config import EngineArgs
    from pagedllm.engine.builder import load_config
    from pagedllm.worker.model_runner import kv_cache_bytes_per_block

    config = load_config(EngineArgs(model=args.model, max_model_len=args.max_model_len))
    per_token = kv_cache_bytes_per_block(config, 16) // 16
    return args.docs * args.doc_tokens * per_token // 4


def child_docs(args: argparse.Namespace) -> dict:
    docs = [_tokens(1000 + d, args.doc_tokens) for d in range(args.docs)]
    requests = [docs[r % args.docs] + _tokens(5000 + r, 16) for r in range(args.requests)]
    llm = _llm(args, args.store, _doc_kv_budget(args))
    _warm(llm)
    if args.store:  # the first pass writes every document (not timed)
        _generate(llm, [d + _tokens(4000, 16) for d in docs], 1)
    seconds = _generate(llm, requests, args.max_tokens)
    stats = llm.engine.stats()
    llm.engine.shutdown()
    return {"seconds": seconds, "req_per_s": len(requests) / seconds, "hit_blocks": stats.kv_tier_hits}


def child_preempt(args: argparse.Namespace) -> dict:
    from pagedllm.config import EngineArgs
    from pagedllm.engine.builder import load_config
    from pagedllm.worker.model_runner import kv_cache_bytes_per_block

    config = load_config(EngineArgs(model=args.model, max_model_len=args.max_model_len))
    demand = args.seqs * (args.prompt_tokens + args.output_tokens) * kv_cache_bytes_per_block(config, 16) // 16
    llm = _llm(args, args.store, max(demand // 4, args.max_model_len * kv_cache_bytes_per_block(config, 16) // 16))
    _warm(llm)
    prompts = [_tokens(7000 + s, args.prompt_tokens) for s in range(args.seqs)]
    seconds = _generate(llm, prompts, args.output_tokens)
    stats = llm.engine.stats()
    llm.engine.shutdown()
    return {
        "tok_per_s": args.seqs * args.output_tokens / seconds,
        "preemptions": stats.num_preemptions,
        "hit_blocks": stats.kv_tier_hits,
    }


CHILDREN = {"fill": child_fill, "ttft": child_ttft, "docs": child_docs, "preempt": child_preempt}


# -- the parent: fresh stores, processes, figures -------------------------------------------------------
def _child(args: argparse.Namespace, part: str, store: str | None, order: int = 0) -> dict:
    command = [sys.executable, __file__, args.mode, "--child", part, "--order", str(order)]
    command += ["--model", args.model] if args.model else []
    for name in ("doc_tokens", "docs", "requests", "max_tokens", "seqs", "prompt_tokens", "output_tokens"):
        command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    command += ["--max-model-len", str(args.max_model_len), "--kv-cache-memory", str(args.kv_cache_memory)]
    command += ["--kv-offload-size", args.kv_offload_size] + (["--store", store] if store else [])
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{part} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def _summary(name: str, values: list[float], unit: str = "") -> str:
    return (
        f"{name}: median {statistics.median(values):.3f}{unit} "
        f"(N={len(values)}, {min(values):.3f}-{max(values):.3f}; runs {', '.join(f'{v:.3f}' for v in values)})"
    )


def run_ttft(args: argparse.Namespace) -> None:
    rows = []
    for run in range(args.runs):
        store = tempfile.mkdtemp(prefix="kv-offload-bench-", dir=args.store_parent)
        try:
            _child(args, "fill", store)
            if args.drop_caches:
                _drop_caches()
            rows.append(_child(args, "ttft", store, order=run % 2))
        finally:
            shutil.rmtree(store, ignore_errors=True)
        print(f"run {run}: {rows[-1]}", flush=True)
    print(_summary("TTFT with the store", [r["store"] for r in rows], " s"))
    print(_summary("TTFT recomputed", [r["none"] for r in rows], " s"))
    print(_summary("ratio recompute / store", [r["none"] / r["store"] for r in rows], "x"))


def run_pair(args: argparse.Namespace, figure: str) -> None:
    rows = []
    for run in range(args.runs):
        row = {}
        for arm in ["store", "none"] if run % 2 == 0 else ["none", "store"]:
            store = tempfile.mkdtemp(prefix="kv-offload-bench-", dir=args.store_parent) if arm == "store" else None
            try:
                row[arm] = _child(args, args.mode, store)
            finally:
                if store:
                    shutil.rmtree(store, ignore_errors=True)
        rows.append(row)
        print(f"run {run}: {row}", flush=True)
    print(_summary(f"{figure} with the store", [r["store"][figure] for r in rows]))
    print(_summary(f"{figure} without", [r["none"][figure] for r in rows]))
    print(_summary("ratio store / none", [r["store"][figure] / r["none"][figure] for r in rows], "x"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["ttft", "docs", "preempt"])
    p.add_argument("--model", default=None, help="default: the default model")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--doc-tokens", type=int, default=None, help="ttft: 4096; docs: 2048")
    p.add_argument("--docs", type=int, default=64)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--seqs", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--output-tokens", type=int, default=384)
    p.add_argument("--max-model-len", type=int, default=None, help="default: doc + 64 tokens, or prompt + output")
    p.add_argument("--kv-cache-memory", default="2GiB")
    p.add_argument("--kv-offload-size", default="16GiB")
    p.add_argument("--drop-caches", action="store_true", help="ttft: empty the page cache before the restart")
    p.add_argument("--busy", type=int, default=0, help="busy processes beside the measurement")
    p.add_argument("--store-parent", default=None, help="where the stores are made (default: the temp dir)")
    p.add_argument("--child", choices=list(CHILDREN), default=None, help=argparse.SUPPRESS)
    p.add_argument("--order", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--store", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.doc_tokens is None:
        args.doc_tokens = 4096 if args.mode == "ttft" else 2048
    if args.max_model_len is None:
        args.max_model_len = args.prompt_tokens + args.output_tokens if args.mode == "preempt" else args.doc_tokens + 64
    if args.child:
        print(json.dumps(CHILDREN[args.child](args)))
        return
    print(f"command: {' '.join(sys.argv)}", flush=True)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        if args.mode == "ttft":
            run_ttft(args)
        else:
            run_pair(args, "req_per_s" if args.mode == "docs" else "tok_per_s")
    finally:
        for process in busy:
            process.kill()


if __name__ == "__main__":
    main()
