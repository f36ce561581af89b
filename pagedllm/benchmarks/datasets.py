"""Synthetic requests: (prompt token ids, output tokens) pairs, seeded, over a vocabulary's ids
(the first and last hundred left out: special tokens tend to sit there)."""

from __future__ import annotations

import random

Requests = list[tuple[list[int], int]]


def fixed_workload(vocab: int, seed: int = 0, count: int = 64, input_len: int = 128, output_len: int = 128) -> Requests:
    rng = random.Random(seed)
    return [([rng.randrange(100, vocab - 100) for _ in range(input_len)], output_len) for _ in range(count)]


def variable_workload(vocab: int, seed: int = 0, count: int = 200) -> Requests:
    """Heavy-tailed lengths like ShareGPT's: input 4..1024, output 4..512 (log-normal, clipped)."""
    rng = random.Random(seed)
    requests = []
    for _ in range(count):
        n_in = min(1024, max(4, int(rng.lognormvariate(5.0, 1.0))))
        n_out = min(512, max(4, int(rng.lognormvariate(4.8, 0.9))))
        requests.append(([rng.randrange(100, vocab - 100) for _ in range(n_in)], n_out))
    return requests


def shared_prefix_workload(vocab: int, seed: int = 0) -> Requests:
    rng = random.Random(seed)
    prefix = [rng.randrange(100, vocab - 100) for _ in range(512)]
    return [(prefix + [rng.randrange(100, vocab - 100) for _ in range(32)], 128) for _ in range(64)]


WORKLOADS = {"fixed": fixed_workload, "variable": variable_workload, "shared": shared_prefix_workload}
