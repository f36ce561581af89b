"""Prometheus metrics with vLLM's meanings, named `pagedllm:<name>`."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pagedllm.core.scheduler import SchedulerStats
from pagedllm.outputs import EmbeddingRequestOutput, RequestOutput

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0, 640.0)


class EngineMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"pagedllm:{name}", doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"pagedllm:{name}", doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(f"pagedllm:{name}", doc, labels, buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)

        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV cache usage: 1 means every block in use.")
        self.kv_blocks_free = gauge("kv_cache_free_blocks", "KV cache blocks free.")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("num_preemptions", "Requests preempted (recomputed later).")
        self.spec_drafts = counter("spec_decode_num_drafts", "Speculative decoding: draft proposals verified.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Speculative decoding: draft tokens verified.")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens accepted.")
        # As vLLM's: a counter a draft position, labelled `position` (0: a draft's first token).
        self._spec_per_position = Counter("pagedllm:spec_decode_num_accepted_tokens_per_pos",
                                          "Speculative decoding: accepted draft tokens at each position.",
                                          labels + ["position"], registry=r)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.ttft = histogram("time_to_first_token_seconds", "Time from arrival to the first token.")
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive output tokens.")
        self.e2e = histogram("e2e_request_latency_seconds", "Time from arrival to the last token.")
        self.queue_time = histogram("request_queue_time_seconds", "Time waiting before first scheduled.")
        self._success = Counter("pagedllm:request_success", "Finished requests by finish reason.",
                                labels + ["finished_reason"], registry=r)
        self.model_name = model_name
        self._seen = {"preemptions": 0, "queries": 0, "hits": 0, "drafts": 0, "draft_tokens": 0, "accepted": 0}
        self._seen_per_position: list[int] = []

    def observe_tokens(self, stream, count: int, now: float) -> None:
        """`count` tokens arrived for a request at `now` (one engine step's worth)."""
        if stream.last_token is None:
            self.ttft.observe(now - stream.arrival)
        else:
            self.itl.observe((now - stream.last_token) / count)
        stream.last_token = now
        stream.num_generated += count
        self.generation_tokens.inc(count)

    def observe_finished(self, stream, output: RequestOutput | EmbeddingRequestOutput, now: float) -> None:
        self.e2e.observe(now - stream.arrival)
        self.prompt_tokens.inc(stream.num_prompt_tokens)
        if isinstance(output, EmbeddingRequestOutput):  # ends in one step: no tokens, no queue time kept
            self._success.labels(self.model_name, "stop" if output.error is None else "error").inc()
            return
        queue_time = output.metrics.get("queue_time")
        if queue_time is not None:
            self.queue_time.observe(queue_time)
        for sample in output.outputs:
            if sample.finish_reason:
                self._success.labels(self.model_name, sample.finish_reason).inc()

    def render(self, stats: SchedulerStats) -> bytes:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        self.kv_blocks_free.set(stats.kv_blocks_free)
        # The engine keeps running totals; the counters take what is new since the last scrape.
        for key, counter, total in (("preemptions", self.preemptions, stats.num_preemptions),
                                    ("queries", self.prefix_queries, stats.prefix_cache_queries),
                                    ("hits", self.prefix_hits, stats.prefix_cache_hits),
                                    ("drafts", self.spec_drafts, stats.spec_num_drafts),
                                    ("draft_tokens", self.spec_draft_tokens, stats.spec_num_draft_tokens),
                                    ("accepted", self.spec_accepted, stats.spec_num_accepted_tokens)):
            counter.inc(total - self._seen[key])
            self._seen[key] = total
        seen = self._seen_per_position
        seen += [0] * (len(stats.spec_accepted_per_position) - len(seen))
        for position, total in enumerate(stats.spec_accepted_per_position):
            self._spec_per_position.labels(self.model_name, str(position)).inc(total - seen[position])
            seen[position] = total
        return generate_latest(self.registry)
