"""Greedy tokens and logprobs of this tree against an older commit's, on the default model, its
GGUF weights kept quantized and dequantized (--quantization gguf / none): whether a change that
should not move outputs moved them.

    .venv/bin/python benchmarks/same_outputs.py --against 1ba24a7

The commit runs from a git worktree (alternate.py's), in a process of its own with
`PYTHONPATH=<worktree>`. Prints, per quantization, how many prompts gave the same tokens and the
same logprobs (to 1e-6) and exits 1 if any did not.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from alternate import worktree

PROMPTS = ["The history of the printing press", "Write a haiku about rain.", "def fibonacci(n):", "Les fleurs"]


def generate(out: str) -> None:
    """This process's pagedllm: each quantization's greedy tokens and logprobs, to `out` as JSON."""
    from pagedllm import LLM, SamplingParams

    results = {}
    for quantization in ("gguf", "none"):
        llm = LLM(quantization=quantization, kv_cache_memory="256MiB")
        params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=1)
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        results[quantization] = [
            [
                list(o.outputs[0].token_ids),
                [round(max(d.values(), key=lambda p: p.logprob).logprob, 6) for d in o.outputs[0].logprobs],
            ]
            for o in outputs
        ]
        llm.engine.shutdown()
    with open(out, "w") as f:
        json.dump(results, f)


def _chosen_logprobs(output) -> list[float]:
    return [round(max(d.values(), key=lambda p: p.logprob).logprob, 6) for d in output.outputs[0].logprobs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", help="the older commit")
    parser.add_argument("--generate", help=argparse.SUPPRESS)  # (the child's: write the outputs here)
    args = parser.parse_args()
    if args.generate:
        generate(args.generate)
        return
    runs = {}
    for name, env in (("this tree", {}), (args.against, {"PYTHONPATH": str(worktree(args.against))})):
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            command = [sys.executable, __file__, "--generate", out.name]
            subprocess.run(command, env={**os.environ, **env}, check=True, cwd=tempfile.gettempdir())
            runs[name] = json.load(open(out.name))
    ours, theirs = runs["this tree"], runs[args.against]
    same = True
    for quantization in ours:
        pairs = list(zip(ours[quantization], theirs[quantization]))
        tokens = sum(a[0] == b[0] for a, b in pairs)
        logprobs = sum(a[1] == b[1] for a, b in pairs)
        print(f"{quantization}: same tokens {tokens}/{len(pairs)}, same logprobs {logprobs}/{len(pairs)}")
        same &= tokens == logprobs == len(pairs)
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
