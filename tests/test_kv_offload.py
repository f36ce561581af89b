"""The KV cache's second tier (--kv-offload-dir): blocks written to an LMDB store, read back after a
restart or an eviction from memory, bit for bit what computing them gives; a damaged, foreign,
unwritable or full store degrades to recomputing, never to a wrong answer or a failed request."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import lmdb
import pytest
import torch
from openai import OpenAI

from pagedllm import LLM, SamplingParams
from pagedllm.core.block_pool import BlockPool
from pagedllm.core.kv_tier import KVTier
from pagedllm.core.step import KVStoreReport
from pagedllm.lora.request import LoRARequest
from server_utils import Server

BS = 4
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
# A few blocks more than max_model_len: one request's blocks evict another's.
SMALL_KV = {"kv_cache_memory": 30 * BS * 512, "max_model_len": 96, "max_num_seqs": 4}


def _prompts(n: int = 3, length: int = 41) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, 30000, (length,), generator=g).tolist() for _ in range(n)]


def _llm(model: str, store: Path | str | None, **kwargs) -> LLM:
    args = {"dtype": "float32", "kv_cache_memory": "16MiB", "block_size": BS, **kwargs}
    return LLM(model, kv_offload_dir=str(store) if store is not None else None, **args)


def _run(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[dict[int, float]]]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    return [
        (o.outputs[0].token_ids, [{t: lp.logprob for t, lp in e.items()} for e in o.outputs[0].logprobs])
        for o in outputs
    ]


def _done(llm: LLM):
    """The engine's stats once every request ended (every block free again), then the store closed."""
    stats = llm.engine.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total
    llm.engine.shutdown()
    return stats


@pytest.fixture(scope="module")
def reference(llama_dir):
    """Every prompt computed alone, no prefix cache, no store."""
    llm = _llm(llama_dir, None, enable_prefix_caching=False)
    return [_run(llm, [p])[0] for p in _prompts()]


def test_blocks_read_back_after_a_restart_are_bitwise_the_computed_ones(llama_dir, tmp_path, reference):
    first = _llm(llama_dir, tmp_path)
    assert _run(first, _prompts()) == reference
    written = _done(first)
    assert written.kv_tier_write_blocks >= 3 * 10 and written.kv_tier_hits == 0

    again = _llm(llama_dir, tmp_path)
    assert _run(again, _prompts()) == reference  # tokens and logprobs, exactly
    stats = _done(again)
    # Each 41-token prompt: its 10 full blocks before the last token, read instead of computed.
    assert stats.kv_tier_hits == 3 * 10 and stats.prefix_cache_hits == 3 * 10 * BS
    assert stats.kv_tier_failures == 0 and stats.kv_tier_read_bytes > 0


def test_blocks_evicted_from_memory_come_back_from_the_store(llama_dir, tmp_path, reference):
    llm = _llm(llama_dir, tmp_path, **SMALL_KV)
    prompts = _prompts()
    outputs = [_run(llm, [p])[0] for p in prompts]  # each evicts most of the one before
    outputs.append(_run(llm, [prompts[0]])[0])
    assert outputs == reference + reference[:1]
    stats = _done(llm)
    assert stats.kv_tier_hits > 0  # the first prompt's blocks, gone from memory, read from disk


def test_preempted_requests_resume_from_the_store(llama_dir, tmp_path, reference):
    """Four requests in a pool that holds two: preemptions; their outputs stay each one's alone."""
    llm = _llm(llama_dir, tmp_path, **SMALL_KV)
    prompts = _prompts(4)
    params = SamplingParams(temperature=0, max_tokens=36, ignore_eos=True)
    alone = [llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    together = [
        o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ]
    assert together == alone
    stats = _done(llm)
    assert stats.num_preemptions > 0 and stats.kv_tier_hits > 0


@pytest.mark.parametrize("other", [{"dtype": "bfloat16"}, {"kv_cache_dtype": "fp8"}, {"block_size": 8}])
def test_another_dtype_or_block_size_never_hits(llama_dir, tmp_path, other):
    first = _llm(llama_dir, tmp_path)
    _run(first, _prompts())
    _done(first)
    llm = _llm(llama_dir, tmp_path, **other)
    assert llm.engine.stats().kv_tier_blocks == 0
    _run(llm, _prompts())
    assert _done(llm).kv_tier_hits == 0


def test_another_model_never_hits(tiny_models, tmp_path):
    prompts = _prompts()
    first = _llm(tiny_models["llama"], tmp_path)
    _run(first, prompts)
    _done(first)
    other = _llm(tiny_models["qwen2"], tmp_path)
    assert other.engine.stats().kv_tier_blocks == 0
    _run(other, prompts)
    assert _done(other).kv_tier_hits == 0


def test_adapters_key_blocks_by_their_content(tmp_path):
    """An adapter's blocks are keyed by its files' content: rewritten in place, it is another adapter."""
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_model.safetensors").write_bytes(b"one")
    key = LoRARequest("a", 1, str(folder)).cache_key
    assert LoRARequest("b", 2, str(folder)).cache_key == key  # another id, the same files: the same K/V
    (folder / "adapter_model.safetensors").write_bytes(b"two")
    assert LoRARequest("a", 1, str(folder)).cache_key != key


def test_a_damaged_block_is_dropped_and_computed(llama_dir, tmp_path, reference):
    first = _llm(llama_dir, tmp_path)
    _run(first, _prompts())
    _done(first)
    data = tmp_path / "data.mdb"
    env = lmdb.open(str(tmp_path), readonly=True, lock=False, max_dbs=2)
    with env.begin(db=env.open_db(b"blocks", create=False)) as txn:
        payload = bytes(next(iter(txn.cursor()))[1])[16:]
    env.close()
    raw = bytearray(data.read_bytes())
    at = raw.find(payload[:64])
    assert at > 0
    raw[at + 8] ^= 0x40  # one bit of one K value
    data.write_bytes(bytes(raw))

    again = _llm(llama_dir, tmp_path)
    assert _run(again, _prompts()) == reference
    stats = _done(again)
    assert stats.kv_tier_failures >= 1 and stats.kv_tier_hits < 3 * 10


def test_a_truncated_store_is_set_aside(llama_dir, tmp_path, reference):
    store = tmp_path / "kv"
    first = _llm(llama_dir, store)
    _run(first, _prompts())
    _done(first)
    data = store / "data.mdb"
    os.truncate(data, data.stat().st_size // 3)

    again = _llm(llama_dir, store)
    assert again.engine.stats().kv_tier_blocks == 0
    assert _run(again, _prompts()) == reference
    assert _done(again).kv_tier_hits == 0
    assert [p.name.startswith("kv.damaged-") for p in tmp_path.iterdir()].count(True) == 1


def test_an_unusable_directory_degrades_to_recompute(llama_dir, reference):
    llm = _llm(llama_dir, "/proc/pagedllm-kv-store")  # cannot be created
    assert _run(llm, _prompts()) == reference
    assert _done(llm).kv_tier_hits == 0


def test_a_full_disk_loses_writes_not_requests(llama_dir, tmp_path, reference):
    """Files may not grow past 96 KiB (RLIMIT_FSIZE, as a full disk): the writer's writes fail, the
    requests do not."""
    script = textwrap.dedent(
        f"""
        import json, resource, signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (96 << 10, resource.RLIM_INFINITY))
        from pagedllm import LLM, SamplingParams
        llm = LLM({llama_dir!r}, dtype="float32", kv_cache_memory="16MiB", block_size={BS},
                  kv_offload_dir={str(tmp_path)!r})
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        outs = [llm.generate({{"prompt_token_ids": p}}, params, use_tqdm=False)[0].outputs[0].token_ids
                for p in {_prompts(3, 200)!r}]
        llm.engine.shutdown()
        print(json.dumps(outs))
        """
    )
    env = {**os.environ, "PAGEDLLM_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    alone = _llm(llama_dir, None, enable_prefix_caching=False)
    expected = [
        o.outputs[0].token_ids
        for o in alone.generate(
            [{"prompt_token_ids": p} for p in _prompts(3, 200)],
            SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
            use_tqdm=False,
        )
    ]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == expected
    assert "KV offload: a write failed" in done.stderr


def test_tier_reads_hold_the_pool_invariants():
    """A read's blocks are held only for its step: loaded ones become cached free blocks, failed
    ones plain free blocks, and the reader's memory hits are held meanwhile and let go."""
    pool = BlockPool(8)
    tier = KVTier.of({1, 2, 3}, block_bytes=100, block_size=4)
    hit = pool.get_new_blocks(1)[0]
    pool.cache_block(hit, 99)
    pool.free_blocks([hit])
    assert tier.start_load("r", [(1,), (2,), (4,), (3,)], pool, [hit], 5, 0) == "started"  # the run before 4
    assert tier.start_load("r", [(1,)], pool, [], 1, 0) == "no"  # once per wait
    assert [h for h, _ in tier.step_loads()] == [1, 2]
    assert hit.ref_cnt == 1 and pool.num_free_blocks == 8 - 3
    tier.finish_loads(KVStoreReport(loaded=[1], failed=[2]), pool)
    assert pool.num_free_blocks == 8 and hit.ref_cnt == 0
    assert pool.lookup(1) is not None and pool.lookup(2) is None and pool.lookup(99) is hit
    assert tier.stored == {1, 3} and tier.stats()["kv_tier_hits"] == 1 and tier.stats()["kv_tier_failures"] == 1


def test_reading_is_skipped_where_computing_is_faster():
    pool = BlockPool(8)
    tier = KVTier.of({1}, block_bytes=10**9, block_size=4)  # a second a block to read
    tier.observe_prefill(tokens=1000, seconds=0.001)
    assert tier.start_load("r", [(1,)], pool, [], 1, 0) == "no"


def test_a_read_waits_for_room_for_itself_and_what_its_request_will_take():
    pool = BlockPool(8)
    tier = KVTier.of({1, 2, 3}, block_bytes=100, block_size=4)
    # 3 read + 4 after it + 2 the running ones may take > 8 free: next step.
    assert tier.start_load("r", [(1,), (2,), (3,)], pool, [], 7, 2) == "wait"
    assert tier.start_load("r", [(1,), (2,), (3,)], pool, [], 7, 1) == "started"
    assert tier.start_load("s", [(1,)], pool, [], 2, 0) == "wait"  # 1 + its 1 after + r's 4 > 5 free
    assert tier.start_load("s", [(1,)], pool, [], 1, 0) == "started"


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory, tokenizer_dir) -> str:
    from test_gemma3 import make_gemma3

    return make_gemma3(tmp_path_factory.mktemp("gemma3"), tokenizer_dir)


@pytest.mark.parametrize(
    "model, args",
    [
        ("mistral", {}),  # one sliding window: blocks behind it freed
        ("gemma3", {}),  # sliding and full layers: a block table a group, a key a group
        ("llama", {"kv_cache_dtype": "fp8"}),
        ("llama", {"speculative_config": NGRAM}),
        ("llama", {"speculative_config": "draft"}),  # the draft recomputes what it did not write
        ("llama", {"engine_core_process": True}),
        pytest.param("llama", {"tensor_parallel_size": 2}, marks=pytest.mark.e2e),  # each rank its shard
        pytest.param("llama", {"data_parallel_size": 2}, marks=pytest.mark.e2e),  # replicas share the store
    ],
    ids=["sliding-window", "hybrid", "fp8", "ngram", "draft-model", "core-process", "tp2", "dp2"],
)
def test_restart_hits_wherever_the_prefix_cache_works(tiny_models, gemma3_dir, tmp_path, model, args):
    """Greedy outputs (and seeded samples, n=2) after a restart are those of an engine without the
    store, with blocks read back."""
    path = gemma3_dir if model == "gemma3" else tiny_models[model]
    if args.get("speculative_config") == "draft":
        args = {"speculative_config": {"model": tiny_models["llama"], "num_speculative_tokens": 3}}
    prompts = [{"prompt_token_ids": p} for p in _prompts()]
    params = [PARAMS, SamplingParams(n=2, temperature=0.9, seed=7, max_tokens=6, ignore_eos=True)]

    def outputs(llm: LLM) -> list:
        return [
            [(c.token_ids, c.logprobs) for c in o.outputs]
            for p in params
            for o in llm.generate(prompts, p, use_tqdm=False)
        ]

    plain = _llm(path, None, **{k: v for k, v in args.items() if k != "data_parallel_size"})
    expected = outputs(plain)
    plain.engine.shutdown()
    for attempt in range(2):
        llm = _llm(path, tmp_path, **args)
        got = outputs(llm)
        stats = llm.engine.stats()
        llm.engine.shutdown()
        assert _logprob_values(got) == _logprob_values(expected), attempt
        assert (stats.kv_tier_hits > 0) == (attempt == 1) and stats.kv_tier_failures == 0


def _logprob_values(outputs: list) -> list:
    return [
        [(tokens, [{t: lp.logprob for t, lp in e.items()} for e in logprobs or []]) for tokens, logprobs in request]
        for request in outputs
    ]


def _metric(server, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


@pytest.mark.e2e
def test_a_restarted_server_answers_from_the_store(llama_dir, tmp_path):
    """`pagedllm serve --kv-offload-dir`: a restarted server reads the blocks the last one wrote
    (the official client's answers equal), and /metrics shows the tier."""
    args = ("--kv-offload-dir", str(tmp_path / "kv"), "--kv-offload-size", "64MiB", "--max-model-len", "512")
    prompt = " ".join(f"word{i}" for i in range(150))
    texts = []
    for attempt in range(2):
        server = Server(llama_dir, *args)
        try:
            client = OpenAI(base_url=f"{server.url}/v1", api_key="none")
            done = client.completions.create(model=llama_dir, prompt=prompt, max_tokens=8, temperature=0)
            texts.append(done.choices[0].text)
            hits, blocks = (
                _metric(server, "pagedllm:kv_offload_hits_total"),
                _metric(server, "pagedllm:kv_offload_blocks"),
            )
        finally:
            server.stop()
        assert blocks > 0 and (hits > 0) == (attempt == 1)
    assert texts[0] == texts[1]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--kv-offload-size", "12"], "kv_offload_size must be at least 1MiB"),
        (["--kv-offload-size", "lots"], "cannot read a memory size"),
        (["--no-enable-prefix-caching"], "needs prefix caching enabled"),
    ],
)
def test_bad_offload_flags_stop_the_start_with_a_clear_message(tmp_path, flags, message):
    command = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--kv-offload-dir", str(tmp_path), *flags]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and message in done.stderr, done.stderr[-2000:]


def _store(path: Path, size: int = 1 << 20, digest: bytes = b"m" * 16):
    from pagedllm.config import KVOffloadConfig
    from pagedllm.worker.kv_store import KVStore

    return KVStore(KVOffloadConfig(str(path), size, digest))


def _read(store, hashes: list[int]) -> list[bytes | None]:
    got: dict[int, bytes] = {}

    def into(i: int, payload: memoryview) -> bool:
        got[i] = bytes(payload)
        return True

    found = store.read(hashes, into)
    return [got.get(i) if ok else None for i, ok in enumerate(found)]


def test_the_store_keeps_its_budget_least_recently_used_first_across_restarts(tmp_path):
    block = 100 << 10  # ten fit the 1 MiB budget
    store = _store(tmp_path)
    for h in range(6):
        store.save(h, bytes([h]) * block)
    store.flush()
    assert _read(store, [0]) == [bytes([0]) * block]  # 0 is now the most recently used
    store.flush()
    store.save(6, bytes([6]) * block)  # (a write records the reads' uses too)
    store.close()

    store = _store(tmp_path)  # the order survives the restart
    for h in range(7, 12):
        store.save(h, bytes([h]) * block)
    store.flush()
    kept = set(store.hashes())
    assert len(kept) * (block + 16) <= 1 << 20
    assert {1, 2} & kept == set() and 0 in kept and {7, 8, 9, 10, 11} <= kept
    assert {1, 2} <= set(store.take_report().dropped)
    assert _read(store, [1, 0]) == [None, bytes([0]) * block]
    store.close()


def test_the_store_keeps_models_apart(tmp_path):
    one = _store(tmp_path, digest=b"a" * 16)
    one.save(5, b"x" * 1000)
    one.close()
    other = _store(tmp_path, digest=b"b" * 16)
    assert other.hashes() == [] and _read(other, [5]) == [None]
    other.close()
    again = _store(tmp_path, digest=b"a" * 16)
    assert again.hashes() == [5] and _read(again, [5]) == [b"x" * 1000]
    again.close()


def test_a_second_engine_in_the_process_goes_without_the_open_store(tmp_path):
    first = _store(tmp_path)
    second = _store(tmp_path)
    first.save(1, b"y" * 100)
    first.flush()
    assert second.env is None and _read(second, [1]) == [None] and second.hashes() == []
    second.save(2, b"z")  # dropped, reported
    assert second.take_report().dropped == [2]
    first.close()


def test_adapter_blocks_come_back_only_under_their_adapter(llama_dir, tmp_path):
    from lora_utils import make_adapter

    adapters = {n: make_adapter(llama_dir, tmp_path / n, rank=4, seed=s) for n, s in (("a", 1), ("b", 2))}
    lora = {n: LoRARequest(n, i + 1, path) for i, (n, path) in enumerate(adapters.items())}
    prompt = {"prompt_token_ids": _prompts(1)[0]}
    store = tmp_path / "kv"

    def run(llm: LLM, name: str | None) -> list[int]:
        out = llm.generate(prompt, PARAMS, lora_request=lora[name] if name else None, use_tqdm=False)
        return out[0].outputs[0].token_ids

    plain = _llm(llama_dir, None, enable_lora=True)
    expected = {n: run(plain, n) for n in ("a", "b", None)}
    first = _llm(llama_dir, store, enable_lora=True)
    assert run(first, "a") == expected["a"]
    _done(first)
    again = _llm(llama_dir, store, enable_lora=True)
    assert run(again, None) == expected[None] and run(again, "b") == expected["b"]
    assert again.engine.stats().kv_tier_hits == 0  # "a"'s blocks are neither the base model's nor "b"'s
    assert run(again, "a") == expected["a"]
    assert _done(again).kv_tier_hits == 10
