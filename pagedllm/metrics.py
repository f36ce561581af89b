"""Prometheus metrics with vLLM's meanings, named `pagedllm:<name>`."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pagedllm.core.messages import SchedulerStats
from pagedllm.outputs import EmbeddingRequestOutput, RequestOutput

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
)


class EngineMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"pagedllm:{name}", doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(f"pagedllm:{name}", doc, labels, buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)

        # The scheduler's series, one per engine replica (label `engine`, "0" without data parallelism).
        def per_engine(kind, name: str, doc: str, extra: tuple[str, ...] = ()):
            return kind(f"pagedllm:{name}", doc, labels + ["engine", *extra], registry=r)

        self.running = per_engine(Gauge, "num_requests_running", "Requests in the running batch.")
        self.waiting = per_engine(Gauge, "num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = per_engine(Gauge, "kv_cache_usage_perc", "KV cache usage: 1 means every block in use.")
        self.kv_blocks_free = per_engine(Gauge, "kv_cache_free_blocks", "KV cache blocks free.")
        self.encoder_usage = per_engine(
            Gauge, "encoder_cache_usage_perc", "Encoder cache usage (images' embeddings): 1 means full."
        )
        self.kv_tier_blocks = per_engine(
            Gauge, "kv_offload_blocks", "KV blocks held by the disk tier (--kv-offload-dir)."
        )
        self.kv_tier_bytes = per_engine(Gauge, "kv_offload_bytes", "Bytes of K/V held by the disk tier.")
        self._totals = {  # SchedulerStats' running totals -> the counters that take what is new
            "num_preemptions": per_engine(Counter, "num_preemptions", "Requests preempted (recomputed later)."),
            "prefix_cache_queries": per_engine(
                Counter, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
            ),
            "prefix_cache_hits": per_engine(Counter, "prefix_cache_hits", "Prompt tokens found in the prefix cache."),
            "spec_num_drafts": per_engine(
                Counter, "spec_decode_num_drafts", "Speculative decoding: draft proposals verified."
            ),
            "spec_num_draft_tokens": per_engine(
                Counter, "spec_decode_num_draft_tokens", "Speculative decoding: draft tokens verified."
            ),
            "spec_num_accepted_tokens": per_engine(
                Counter, "spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens accepted."
            ),
            "encoder_cache_queries": per_engine(
                Counter, "encoder_cache_queries", "Images looked up in the encoder cache."
            ),
            "encoder_cache_hits": per_engine(
                Counter, "encoder_cache_hits", "Images found encoded in the encoder cache."
            ),
            "kv_tier_hits": per_engine(Counter, "kv_offload_hits", "KV blocks read from the disk tier, not computed."),
            "kv_tier_failures": per_engine(
                Counter, "kv_offload_failures", "KV blocks the disk tier could not give whole (computed instead)."
            ),
            "kv_tier_read_bytes": per_engine(Counter, "kv_offload_read_bytes", "Bytes read from the disk tier."),
            "kv_tier_read_seconds": per_engine(
                Counter, "kv_offload_read_seconds", "Seconds spent reading the disk tier."
            ),
            "kv_tier_write_blocks": per_engine(
                Counter, "kv_offload_write_blocks", "KV blocks written to the disk tier."
            ),
            "kv_tier_write_bytes": per_engine(Counter, "kv_offload_write_bytes", "Bytes written to the disk tier."),
            "kv_tier_write_seconds": per_engine(
                Counter, "kv_offload_write_seconds", "Seconds the disk tier's writer spent writing (in the background)."
            ),
        }
        # As vLLM's: a counter a draft position, labelled `position` (0: a draft's first token).
        self._spec_per_position = per_engine(
            Counter,
            "spec_decode_num_accepted_tokens_per_pos",
            "Speculative decoding: accepted draft tokens at each position.",
            ("position",),
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.ttft = histogram("time_to_first_token_seconds", "Time from arrival to the first token.")
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive output tokens.")
        self.e2e = histogram("e2e_request_latency_seconds", "Time from arrival to the last token.")
        self.queue_time = histogram("request_queue_time_seconds", "Time waiting before first scheduled.")
        self._success = Counter(
            "pagedllm:request_success", "Finished requests by finish reason.", labels + ["finished_reason"], registry=r
        )
        # LoRA adapters: vLLM's info gauge (its labels name the running and waiting adapters; its
        # value the time it was set), and requests and tokens per adapter.
        self._lora_info = Gauge(
            "pagedllm:lora_requests_info",
            "Running stats on LoRA requests.",
            ["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
            registry=r,
        )
        per_adapter = labels + ["lora_name"]
        self._lora_requests = Counter(
            "pagedllm:lora_requests", "Finished requests per LoRA adapter.", per_adapter, registry=r
        )
        self._lora_prompt_tokens = Counter(
            "pagedllm:lora_prompt_tokens",
            "Prompt tokens of finished requests per LoRA adapter.",
            per_adapter,
            registry=r,
        )
        self._lora_generation_tokens = Counter(
            "pagedllm:lora_generation_tokens", "Tokens generated per LoRA adapter.", per_adapter, registry=r
        )
        self.model_name = model_name
        self._seen: dict[tuple[str, str], int] = {}  # (engine, total's name or position) -> last seen

    def observe_tokens(self, stream, count: int, now: float) -> None:
        """`count` tokens arrived for a request at `now` (one engine step's worth)."""
        if stream.last_token is None:
            self.ttft.observe(now - stream.arrival)
        else:
            self.itl.observe((now - stream.last_token) / count)
        stream.last_token = now
        stream.num_generated += count
        self.generation_tokens.inc(count)
        if stream.lora_name is not None:
            self._lora_generation_tokens.labels(self.model_name, stream.lora_name).inc(count)

    def observe_finished(self, stream, output: RequestOutput | EmbeddingRequestOutput, now: float) -> None:
        self.e2e.observe(now - stream.arrival)
        self.prompt_tokens.inc(stream.num_prompt_tokens)
        if stream.lora_name is not None:
            self._lora_requests.labels(self.model_name, stream.lora_name).inc()
            self._lora_prompt_tokens.labels(self.model_name, stream.lora_name).inc(stream.num_prompt_tokens)
        if isinstance(output, EmbeddingRequestOutput):  # ends in one step: no tokens, no queue time kept
            self._success.labels(self.model_name, "stop" if output.error is None else "error").inc()
            return
        queue_time = output.metrics.get("queue_time")
        if queue_time is not None:
            self.queue_time.observe(queue_time)
        for sample in output.outputs:
            if sample.finish_reason:
                self._success.labels(self.model_name, sample.finish_reason).inc()

    def observe_aborted(self, stream) -> None:
        """A request ended before it finished (its client left, a deadline, shutdown): each of its
        samples counts as finished for reason "abort", as vLLM counts them."""
        self._success.labels(self.model_name, "abort").inc(stream.num_samples)

    def render(self, replicas: list[SchedulerStats]) -> bytes:
        """The exposition, with each engine replica's scheduler stats (as of its last step)."""
        self.update(replicas)
        return generate_latest(self.registry)

    def update(self, replicas: list[SchedulerStats]) -> None:
        """The gauges and counters that follow the engine replicas' scheduler stats."""
        for engine, stats in enumerate(replicas):
            labels = (self.model_name, str(engine))
            self.running.labels(*labels).set(stats.num_running)
            self.waiting.labels(*labels).set(stats.num_waiting)
            self.kv_usage.labels(*labels).set(stats.kv_cache_usage)
            self.kv_blocks_free.labels(*labels).set(stats.kv_blocks_free)
            self.kv_tier_blocks.labels(*labels).set(stats.kv_tier_blocks)
            self.kv_tier_bytes.labels(*labels).set(stats.kv_tier_bytes)
            size = stats.encoder_cache_size
            self.encoder_usage.labels(*labels).set(stats.encoder_cache_used / size if size else 0.0)
            # The engine keeps running totals; the counters take what is new since the last scrape.
            for name, counter in self._totals.items():
                self._advance(counter.labels(*labels), (labels[1], name), getattr(stats, name))
            for position, total in enumerate(stats.spec_accepted_per_position):
                self._advance(self._spec_per_position.labels(*labels, str(position)), (labels[1], str(position)), total)
        self._set_lora_info(SchedulerStats.merge(replicas) if replicas else None)

    def _set_lora_info(self, stats: SchedulerStats | None) -> None:
        self._lora_info.clear()  # one series: the current adapters (the gauge's labels change)
        if stats is None or not stats.max_loras:
            return
        running, waiting = ",".join(stats.running_loras), ",".join(stats.waiting_loras)
        self._lora_info.labels(running, waiting, str(stats.max_loras)).set_to_current_time()

    def _advance(self, counter: Counter, key: tuple[str, str], total: float) -> None:
        counter.inc(total - self._seen.get(key, 0))
        self._seen[key] = total


def render_merged(parts: list[tuple[EngineMetrics, list[SchedulerStats]]]) -> bytes:
    """One exposition of several engines' metrics (a server of several models): each family once,
    with every engine's series (they differ by their model_name label)."""
    families: dict[str, Any] = {}
    for metrics, replicas in parts:
        metrics.update(replicas)
        for family in metrics.registry.collect():
            if family.name in families:
                families[family.name].samples.extend(family.samples)
            else:
                families[family.name] = family

    class _Merged:
        def collect(self):
            return list(families.values())

    return generate_latest(_Merged())  # type: ignore[arg-type]
