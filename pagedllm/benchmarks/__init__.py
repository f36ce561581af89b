"""`pagedllm bench serve|throughput|latency`: the benchmarks of benchmarks/ as commands, with
vLLM's `vllm bench` option names."""
