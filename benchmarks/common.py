"""Helpers the benchmark scripts share: this machine's measured limits, workloads, model facts."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import torch

from pagedllm.config import head_dim  # noqa: F401 - step_bound.py takes it from here too

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("PAGEDLLM_NO_PROGRESS", "1")


def measure_bandwidth_gbs(size_mib: int = 1024, repeats: int = 5) -> float:
    """Read bandwidth: the best of a few full reductions over a buffer far larger than the caches."""
    buf = torch.ones(size_mib * 1024 * 1024 // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - start)
    return buf.numel() * 4 / best / 1e9


def measure_matmul_gflops(dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e9


# The machine's bf16 arithmetic ceiling: each thread issues only independent AVX-512 BF16 pair dot
# products (32 multiply-adds each), 12 chains deep so that their latency is hidden. No memory, no
# loads: what no GEMM can beat, to set the measured matmul rate and our kernels against.
_DOT_PEAK_SOURCE = r"""
#include <immintrin.h>
#include <omp.h>
volatile float sink;
double bf16_dot_peak(long rounds, int threads) {
  double start = omp_get_wtime();
  #pragma omp parallel num_threads(threads)
  {
    __m512 acc[12];
    for (int j = 0; j < 12; j++) acc[j] = _mm512_setzero_ps();
    __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80);
    for (long i = 0; i < rounds; i++) {
      __asm__ volatile("" : "+v"(a));  /* a is opaque: the loop cannot be folded */
      for (int j = 0; j < 12; j++) acc[j] = _mm512_dpbf16_ps(acc[j], a, a);
    }
    float total = 0;
    for (int j = 0; j < 12; j++) total += _mm512_reduce_add_ps(acc[j]);
    sink = total;
  }
  return 2.0 * 32 * 12 * rounds * threads / (omp_get_wtime() - start) / 1e9;
}
"""


def measure_bf16_dot_peak_gflops(threads: int, repeats: int = 5) -> float | None:
    """GFLOP/s of AVX-512 BF16 dot products alone on `threads` threads (best of `repeats`), or None
    where there is no C compiler or no AVX-512 BF16."""
    import ctypes
    import subprocess
    import tempfile

    if not os.path.exists("/proc/cpuinfo") or "avx512_bf16" not in open("/proc/cpuinfo").read():
        return None
    with tempfile.TemporaryDirectory() as tmp:
        source, library = os.path.join(tmp, "peak.c"), os.path.join(tmp, "peak.so")
        with open(source, "w") as f:
            f.write(_DOT_PEAK_SOURCE)
        built = subprocess.run(
            ["cc", "-O3", "-mavx512f", "-mavx512bf16", "-fopenmp", "-shared", "-fPIC", source, "-o", library],
            capture_output=True,
        )
        if built.returncode != 0:
            return None
        peak = ctypes.CDLL(library).bf16_dot_peak
    peak.restype, peak.argtypes = ctypes.c_double, [ctypes.c_long, ctypes.c_int]
    return max(peak(2_000_000, threads) for _ in range(repeats))


def _linear_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    """The matrices a token multiplies through (plain, packed for oneDNN, or a quantized layer's
    records), the output head included."""
    from pagedllm.layers.linear import Linear
    from pagedllm.layers.quantization.gguf import QuantizedEmbedding

    weights = []
    for module in model.modules():
        if isinstance(module, Linear) and not isinstance(module, QuantizedEmbedding):
            packed = [b for name, b in module.named_buffers(recurse=False) if name.startswith("packed_")]
            weights += packed or [module.weight]
    return weights


def weight_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of weights a decode step reads: every matrix (plain, packed for oneDNN, or quantized
    records) and norm, one row of the embedding. Works on a meta model and on a loaded one."""
    from pagedllm.layers.linear import Linear
    from pagedllm.layers.quantization.gguf import QuantizedEmbedding, TiedHead

    total = sum(_nbytes(w) for w in _linear_weights(model))
    tied = any(isinstance(m, TiedHead) for m in model.modules())
    for module in model.modules():
        if isinstance(module, QuantizedEmbedding):  # the whole table where it is the head, else a row
            packed = sum(_nbytes(b) for name, b in module.named_buffers() if name.startswith("packed_"))
            total += packed if tied else packed // module.out_features
        elif isinstance(module, torch.nn.Embedding):
            total += module.weight.shape[1] * module.weight.element_size()
        elif not isinstance(module, Linear):
            total += sum(p.numel() * p.element_size() for p in module.parameters(recurse=False) if p.dim() == 1)
    for module in model.modules():
        if isinstance(module, Linear) and module.bias is not None:
            total += module.bias.numel() * module.bias.element_size()
    return total


def gguf_weight_bytes_per_token(path: str) -> int:
    """The same for a GGUF file's weights as stored: every tensor but the embedding, of which one row
    (all of it where it is also the output head)."""
    import gguf

    reader = gguf.GGUFReader(path)
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    total = 0
    for tensor in reader.tensors:
        if tensor.name == "token_embd.weight" and not tied:
            total += int(tensor.n_bytes) // int(tensor.shape[-1])
        else:
            total += int(tensor.n_bytes)
    return total


def _nbytes(tensor: torch.Tensor) -> int:
    if tensor.layout == torch._mkldnn:
        return torch.ops.mkldnn._nbytes(tensor)
    return tensor.numel() * tensor.element_size()


def matmul_flops_per_token(model: torch.nn.Module) -> int:
    """2 x the parameters a token multiplies through (all but the embedding lookup)."""
    from pagedllm.layers.linear import Linear

    return 2 * sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, Linear))


def attention_flops(config, context: int) -> int:
    """QK^T and PV for one token attending to `context` tokens, all layers."""
    return 4 * config.num_hidden_layers * config.num_attention_heads * head_dim(config) * context


# The workloads live in the package, where `pagedllm bench` takes them too.
from pagedllm.benchmarks.datasets import WORKLOADS, fixed_workload, shared_prefix_workload, variable_workload  # noqa: E402,F401


class PeakTracker:
    """Wraps engine.step to record the most KV blocks in use after any step (and the share of
    their slots holding no token at that peak), and each request's first-output time."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.reset()
        self._step = engine.step
        engine.step = self.step

    def step(self):
        outputs = self._step()
        stats = self.engine.stats()
        used = stats.kv_blocks_total - stats.kv_blocks_free
        if used > self.peak:
            self.peak, self.waste_at_peak = used, stats.kv_waste
        now = time.perf_counter()
        for output in outputs:
            self.first_token.setdefault(output.request_id, now)
        return outputs

    def reset(self) -> None:
        self.peak, self.waste_at_peak, self.first_token = 0, 0.0, {}


class Busy:
    """`count` processes spinning on a core each, for the `with` block."""

    def __init__(self, count: int) -> None:
        self.count, self.processes = count, []

    def __enter__(self) -> Busy:
        self.processes = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(self.count)]
        time.sleep(0.5)
        return self

    def __exit__(self, *exc) -> None:
        for process in self.processes:
            process.kill()
            process.wait()


LORA_TARGETS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def model_hf_config(model: str):
    """transformers' config of a Hugging Face folder or a GGUF file."""
    from transformers import AutoConfig

    if model.endswith(".gguf"):
        return AutoConfig.from_pretrained(os.path.dirname(model) or ".", gguf_file=os.path.basename(model))
    return AutoConfig.from_pretrained(model)


def write_lora_adapter(config, path: str, rank: int, seed: int, scale: float = 0.02) -> str:
    """A PEFT LoRA folder for a model of this transformers config: every target of every layer,
    random A and B of their own seed (alpha 2 x rank)."""
    import json

    from safetensors.torch import save_file

    hidden = config.hidden_size
    head = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q, kv = config.num_attention_heads * head, config.num_key_value_heads * head
    shapes = {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, q)}
    inter = config.intermediate_size
    shapes |= {"gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for block, names in LORA_TARGETS.items():
            for name in names:
                out, inp = shapes[name]
                prefix = f"base_model.model.model.layers.{layer}.{block}.{name}"
                tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, inp, generator=g) * scale
                tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, rank, generator=g) * scale
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    targets = [n for names in LORA_TARGETS.values() for n in names]
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets}, f)
    return path
