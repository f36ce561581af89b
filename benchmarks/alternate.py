"""benchmarks/throughput.py (or serve.py) alternated between this tree, an older commit and vLLM
CPU, in rounds: whether a change cost a workload, measured beside the reference in one sitting.

    .venv/bin/python benchmarks/alternate.py --against 852ef17 --vllm ~/peers/vllm/bin/python \\
        --rounds 3 -- --model /tmp/llama-250m --workload fixed
    .venv/bin/python benchmarks/alternate.py --script serve --against 1ba24a7 --rounds 3 -- \\
        --num-prompts 64 --input-len 128 --output-len 128 --launch

--script serve runs benchmarks/serve.py, whose --launch starts each contender's own server (the
commit's through the PYTHONPATH it inherits); vLLM is not offered there. Each contender runs in
its own tree's folder (a launched server imports pagedllm from there): give paths after `--` in full.

Each round runs every contender once, in turn (every other round in reverse order), each in a
fresh process: this tree (this Python); the commit, from a `git worktree` made for it (its own
throughput.py, `PYTHONPATH=<worktree>`); vLLM, with this tree's script (`--engine vllm`) and the
Python of its venv (where pagedllm is installed too, `pip install --no-deps -e .`), the preloads
and core binding ../shared/peers/README.md gives. The arguments after `--` go to every throughput.py run. Printed:
each contender's median output tok/s with its range, and the median over rounds of this tree's
speed over each other contender's in the same round, with its range.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


def worktree(commit: str) -> Path:
    path = Path(tempfile.gettempdir()) / f"pagedllm-{commit}"
    if not path.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-f", "--detach", str(path), commit], check=True)
    return path


def contenders(args: argparse.Namespace) -> dict[str, tuple[list[str], dict[str, str], Path]]:
    """name -> (command before the shared arguments, environment, working directory). Each runs in
    the tree whose code it measures: a server that serve.py --launch starts (`python -m pagedllm...`)
    imports pagedllm from its working directory before PYTHONPATH."""
    script = f"{args.script}.py"
    here = [sys.executable, str(ROOT / "benchmarks" / script)]
    out = {"this tree": (here, dict(os.environ), ROOT)}
    if args.against:
        tree = worktree(args.against)
        out[args.against] = (
            [sys.executable, str(tree / "benchmarks" / script)],
            {**os.environ, "PYTHONPATH": str(tree)},
            tree,
        )
    if args.vllm and args.script == "throughput":
        iomp = (
            Path(os.path.abspath(args.vllm)).parent.parent / "lib" / "libiomp5.so"
        )  # the venv's, not its python's target
        out["vLLM CPU"] = (
            [args.vllm, *here[1:], "--engine", "vllm"],
            {**os.environ, **VLLM_ENV, "LD_PRELOAD": f"{TCMALLOC}:{iomp}"},
            ROOT,
        )
    return out


def output_tok_s(command: list[str], env: dict[str, str], cwd: Path, shared: list[str]) -> float:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        # (--out first: a serve.py --launch takes every argument after it)
        subprocess.run([*command, "--out", out.name, *shared], env=env, check=True, cwd=cwd, stdout=subprocess.DEVNULL)
        result = json.load(open(out.name))
    if isinstance(result, dict):  # serve.py's
        return result["output_throughput"]
    assert len(result) == 1, "one workload and one request count a run"
    return result[0]["output_tok_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", default=None, help="an older commit to alternate with")
    parser.add_argument("--vllm", default=None, help="the Python of vLLM CPU's venv")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--script", choices=("throughput", "serve"), default="throughput")
    parser.add_argument("shared", nargs=argparse.REMAINDER, help="-- then throughput.py's arguments")
    args = parser.parse_args()
    shared = args.shared[1:] if args.shared[:1] == ["--"] else args.shared
    runs = contenders(args)
    speeds: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(args.rounds):
        order = list(runs.items()) if r % 2 == 0 else list(runs.items())[::-1]  # no contender always first
        for name, (command, env, cwd) in order:
            speeds[name].append(output_tok_s(command, env, cwd, shared))
            print(f"round {r + 1}: {name} {speeds[name][-1]:.1f} output tok/s", flush=True)
    print(f"\n`{args.script}.py {' '.join(shared)}`, {args.rounds} rounds alternated\n")
    print("| contender | output tok/s, median (range) | this tree / it, median of rounds (range) |")
    print("|---|---|---|")
    for name, values in speeds.items():
        ratios = [a / b for a, b in zip(speeds["this tree"], values)]
        ratio = "" if name == "this tree" else f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
        print(f"| {name} | {statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f}) | {ratio} |")


if __name__ == "__main__":
    main()
