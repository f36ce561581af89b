"""pagedllm against llama.cpp on the same GGUF file, in one process, rounds alternated.

Run it with the Python of llama.cpp's venv, where pagedllm is installed too (../shared/peers/README.md,
BENCHMARKS.md):

    ~/peers/llamacpp/bin/python benchmarks/vs_llamacpp.py --gguf /tmp/llama-250m-Q4_K_M.gguf

- batch-1 decode: one request at a time, --new-tokens greedy tokens after a 32-token prompt, for
  pagedllm on the file's quantized weights, llama.cpp (llama-cpp-python's generate), and, with
  --bf16, pagedllm on the same weights dequantized to bf16 (--quantization none). Each round sits
  between two bandwidth readings: the table gives tok/s, the share of the roofline counted in the
  weights' own bytes (ours: as loaded; llama.cpp: as stored), and each round's ratio to llama.cpp.
- time to first token on a --ttft-len-token prompt (median of three each);
- batched throughput (--batch requests x --input-len in x --output-len out, greedy, all at once):
  pagedllm's LLM.generate, and llama.cpp's batched decoding (one sequence per request in one
  context, as its `batched` example and llama-server -np do: the prompts prefilled n_batch tokens
  a call, then one llama_decode a step for every sequence's next token).
Threads: both engines use the machine's physical cores.
"""

from __future__ import annotations

import argparse
import ctypes
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import gguf_weight_bytes_per_token, measure_bandwidth_gbs, weight_bytes_per_token  # noqa: E402


class Ours:
    def __init__(self, path: str, quantization: str | None, max_model_len: int, **options) -> None:
        from pagedllm import LLM

        options.setdefault("kv_cache_memory", "1GiB")
        self.llm = LLM(
            path, quantization=quantization, max_model_len=max_model_len, enable_prefix_caching=False, **options
        )
        self.engine = self.llm.engine
        self.weight_bytes = weight_bytes_per_token(self.engine.model_runner.model)

    def first_and_decode(self, prompt: list[int], new_tokens: int) -> tuple[float, float]:
        from pagedllm import SamplingParams
        from pagedllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            temperature=0, max_tokens=new_tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA
        )
        start = time.perf_counter()
        self.engine.add_request(None, prompt, params)
        first = None
        self.tokens: list[int] = []  # the greedy tokens, for agreement between engines
        while self.engine.has_unfinished_requests():
            outputs = self.engine.step()
            if outputs and first is None:
                first = time.perf_counter()
            self.tokens += [t for o in outputs for t in o.outputs[0].token_ids]
        end = time.perf_counter()
        return first - start, (new_tokens - 1) / (end - first) if new_tokens > 1 else 0.0

    def prefill_and_decode(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
        """The prompts together: seconds until every one has its first token, then the output tok/s
        of the steps after that (every request decoding)."""
        from pagedllm import SamplingParams
        from pagedllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            temperature=0, max_tokens=new_tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA
        )
        start = time.perf_counter()
        for prompt in prompts:
            self.engine.add_request(None, prompt, params)
        started: set[str] = set()
        decoded, all_first = 0, None
        while self.engine.has_unfinished_requests():
            outputs = self.engine.step()
            if all_first is not None:
                decoded += sum(len(o.outputs[0].token_ids) for o in outputs)
            started.update(o.request_id for o in outputs)
            if all_first is None and len(started) == len(prompts):
                all_first = time.perf_counter()
        return all_first - start, decoded / (time.perf_counter() - all_first)

    def batch(self, prompts: list[list[int]], output_len: int) -> float:
        from pagedllm import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        start = time.perf_counter()
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == output_len for o in outputs)
        return len(prompts) * output_len / elapsed


class LlamaCpp:
    def __init__(self, path: str, threads: int, n_ctx: int) -> None:
        import llama_cpp

        self.path, self.threads = path, threads
        self.llm = llama_cpp.Llama(
            model_path=path, n_ctx=n_ctx, n_batch=512, n_threads=threads, n_threads_batch=threads, verbose=False
        )
        self.weight_bytes = gguf_weight_bytes_per_token(path)

    def first_and_decode(self, prompt: list[int], new_tokens: int) -> tuple[float, float]:
        self.llm.reset()  # no prefix of an earlier request's KV cache is reused
        start = time.perf_counter()
        first = end = None
        self.tokens: list[int] = []
        for count, token in enumerate(self.llm.generate(prompt, top_k=1, temp=0.0), start=1):
            end = time.perf_counter()
            first = first or end
            self.tokens.append(token)
            if count == new_tokens:
                break
        return first - start, (new_tokens - 1) / (end - first) if new_tokens > 1 else 0.0

    def batch(self, prompts: list[list[int]], output_len: int) -> float:
        """Every prompt its own sequence of one context; greedy by argmax of each sequence's logits."""
        prefill, decode = self._batch(prompts, output_len)
        return len(prompts) * output_len / (prefill + decode)

    def prefill_and_decode(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
        """As Ours.prefill_and_decode: seconds to every first token, then the decode's output tok/s."""
        prefill, decode = self._batch(prompts, new_tokens)
        return prefill, len(prompts) * (new_tokens - 1) / decode

    def _batch(self, prompts: list[list[int]], output_len: int) -> tuple[float, float]:
        """Seconds of the prefill (to every first token) and of the decode steps after it."""
        import llama_cpp as L

        model = self.llm.model
        params = L.llama_context_default_params()
        params.n_ctx = len(prompts) * (len(prompts[0]) + output_len)
        params.n_batch = params.n_ubatch = 512
        params.n_seq_max = len(prompts)
        params.n_threads = params.n_threads_batch = self.threads
        ctx = L.llama_init_from_model(model, params)
        vocab = L.llama_n_vocab(L.llama_model_get_vocab(model))
        batch = L.llama_batch_init(max(512, len(prompts)), 0, len(prompts))
        try:
            start = time.perf_counter()
            tokens = self._prefill(L, ctx, batch, prompts, vocab)
            prefilled = time.perf_counter()
            positions = [len(p) for p in prompts]
            for _ in range(output_len - 1):
                batch.n_tokens = 0
                for seq, (token, pos) in enumerate(zip(tokens, positions)):
                    self._add(batch, token, pos, seq, True)
                if L.llama_decode(ctx, batch) != 0:
                    raise RuntimeError("llama_decode failed")
                positions = [p + 1 for p in positions]
                tokens = [self._argmax(L, ctx, i, vocab) for i in range(len(prompts))]
            end = time.perf_counter()
        finally:
            L.llama_batch_free(batch)
            L.llama_free(ctx)
        return prefilled - start, end - prefilled

    def _prefill(self, L, ctx, batch, prompts: list[list[int]], vocab: int) -> list[int]:
        """The prompts in calls of up to 512 tokens; each one's first output token, taken from the
        logits of the call that holds its last prompt token (a call's logits go with the next)."""
        pending = [(seq, pos, token) for seq, p in enumerate(prompts) for pos, token in enumerate(p)]
        first = [0] * len(prompts)
        for start in range(0, len(pending), 512):
            batch.n_tokens = 0
            ends = []
            for seq, pos, token in pending[start : start + 512]:
                is_last = pos == len(prompts[seq]) - 1
                if is_last:
                    ends.append((seq, batch.n_tokens))
                self._add(batch, token, pos, seq, is_last)
            if L.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            for seq, index in ends:
                first[seq] = self._argmax(L, ctx, index, vocab)
        return first

    @staticmethod
    def _add(batch, token: int, pos: int, seq: int, logits: bool) -> None:
        i = batch.n_tokens
        batch.token[i] = token
        batch.pos[i] = pos
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = seq
        batch.logits[i] = logits
        batch.n_tokens = i + 1

    @staticmethod
    def _argmax(L, ctx, index: int, vocab: int) -> int:
        logits = L.llama_get_logits_ith(ctx, index)
        return int(np.argmax(np.ctypeslib.as_array(ctypes.cast(logits, ctypes.POINTER(ctypes.c_float)), (vocab,))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--bf16", action="store_true", help="also pagedllm on the weights dequantized to bf16")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ttft-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64, help="requests of the batched run (0: skip it)")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    args = parser.parse_args()
    from pagedllm.executor.cpu_binding import physical_cores

    engines = {"pagedllm": Ours(args.gguf, "gguf", 2048), "llama.cpp": LlamaCpp(args.gguf, physical_cores(), 2048)}
    if args.bf16:
        engines["pagedllm bf16"] = Ours(args.gguf, "none", 2048)
    vocab = engines["pagedllm"].engine.model_config.vocab_size
    rng = random.Random(0)
    prompt = lambda n: [rng.randrange(100, vocab - 100) for _ in range(n)]  # noqa: E731
    for engine in engines.values():
        engine.first_and_decode(prompt(8), 4)  # warm-up

    rounds: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, engine in engines.items():
            before = measure_bandwidth_gbs()
            _, rate = engine.first_and_decode(prompt(32), args.new_tokens)
            bandwidth = (before + measure_bandwidth_gbs()) / 2
            rounds[name].append((rate, rate / (bandwidth * 1e9 / engine.weight_bytes)))
    print(
        f"Batch-1 decode, {args.new_tokens} tokens after 32, {args.rounds} alternated rounds ({Path(args.gguf).name})\n"
    )
    print(
        "| engine | weights MB a token | decode tok/s (median) | % of roofline (median; rounds) | "
        "/ llama.cpp (median of rounds; rounds) |"
    )
    print("|---|---|---|---|---|")
    base = [r for r, _ in rounds["llama.cpp"]]
    for name, engine in engines.items():
        rates = [r for r, _ in rounds[name]]
        shares = sorted(s for _, s in rounds[name])
        ratios = [r / b for r, b in zip(rates, base)]
        print(
            f"| {name} | {engine.weight_bytes / 1e6:.0f} | {statistics.median(rates):.1f} | "
            f"{100 * statistics.median(shares):.0f}% ({100 * shares[0]:.0f}-{100 * shares[-1]:.0f}%) | "
            f"{statistics.median(ratios):.2f} ({', '.join(f'{x:.2f}' for x in ratios)}) |"
        )

    print(f"\nTime to first token, {args.ttft_len}-token prompt (median of 3)\n")
    print("| engine | TTFT ms |\n|---|---|")
    for name, engine in engines.items():
        ttft = statistics.median(engine.first_and_decode(prompt(args.ttft_len), 1)[0] for _ in range(3))
        print(f"| {name} | {ttft * 1000:.0f} |")

    if args.batch:
        prompts = [prompt(args.input_len) for _ in range(args.batch)]
        print(f"\nBatched: {args.batch} requests x {args.input_len} in x {args.output_len} out, output tok/s\n")
        print("| engine | output tok/s | / llama.cpp |\n|---|---|---|")
        rates = {name: engine.batch(prompts, args.output_len) for name, engine in engines.items()}
        for name, rate in rates.items():
            print(f"| {name} | {rate:.1f} | {rate / rates['llama.cpp']:.2f} |")


if __name__ == "__main__":
    main()
