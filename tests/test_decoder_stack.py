"""The C++ decoder stack (kernels/decoder_stack.cpp) against the model's op-by-op path: the same
kernels in the same order, so the same tokens and logprobs to the bit, and the same KV cache; and
the one log line of a model that runs op by op."""

from __future__ import annotations

import logging

import pytest
import torch

from conftest import _config, make_model, prompts_of_mixed_lengths
from pagedllm import LLM, SamplingParams
from pagedllm.kernels import cpu_ops
from pagedllm.layers import linear
from pagedllm.layers.quantization import QuantizationConfig
from pagedllm.logger import LOGGER_NAME
from pagedllm.models import decoder
from pagedllm.models.qwen2 import Qwen2ForCausalLM

# Head size 64: attention's AVX512-BF16 walks exist for it.
_SHAPE = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64, intermediate_size=128)


def _stack_can_build() -> bool:
    """bf16 and fp32 linear layers have a stack kernel wherever the C++ kernels are built (packed
    for oneDNN, or in 16-column blocks)."""
    return cpu_ops() is not None


needs_stack = pytest.mark.skipif(not _stack_can_build(), reason="needs the C++ kernels")


@pytest.fixture(scope="module")
def head64_models(tmp_path_factory, tokenizer_dir) -> dict[str, str]:
    return {
        arch: make_model(arch, tmp_path_factory.mktemp(arch), tokenizer_dir, **_SHAPE)
        for arch in ("llama", "mistral", "qwen2", "qwen3")
    }


def _generate(llm: LLM, prompts: list[list[int]]) -> list[tuple]:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs) for o in outputs]


@needs_stack
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_stack_gives_the_op_by_op_results_bit_for_bit(arch, dtype, head64_models, monkeypatch):
    """Mixed prompt lengths in chunked prefill steps (cached context, several sequences a step),
    then decodes; Mistral's window is smaller than the prompts, Qwen2 has qkv biases, Qwen3 per-head
    q/k norms (its attention's kernel_spec hands the stack their weights), Llama's embeddings are
    tied. The linear calls packed for oneDNN go 8 rows at a time (1024 otherwise), the MLP 24
    (1024 otherwise) and the stack's passes 24 rows (512 otherwise), so that the stack's chunking
    of long batches and its pieces (a 64-token chunk cut at both ends) are checked too. fp32 layers,
    and bf16 ones without AVX512-BF16, are BlockedLinearMethod's (BlockedLinear in the stack)."""
    monkeypatch.setattr(linear, "ROWS_KERNEL_MAX", 8)
    monkeypatch.setattr(decoder, "MLP_ROWS", 24)
    monkeypatch.setattr(decoder, "PIECE_ROWS", 24)
    _assert_stack_is_op_by_op(head64_models[arch], dtype, seed=3)


def _assert_stack_is_op_by_op(folder: str, dtype: str, seed: int) -> None:
    """The same tokens, logprobs and KV caches with the stack as without it, to the bit."""
    stacked, op_by_op = (
        LLM(folder, dtype=dtype, kv_cache_memory="16MiB", block_size=16, max_num_batched_tokens=64) for _ in range(2)
    )
    assert stacked.engine.model_runner.model.stack is not None
    op_by_op.engine.model_runner.model.stack = None
    prompts = prompts_of_mixed_lengths(len(stacked.get_tokenizer()), seed=seed)
    assert _generate(stacked, prompts) == _generate(op_by_op, prompts)
    for ours, theirs in zip(stacked.engine.model_runner.kv_caches, op_by_op.engine.model_runner.kv_caches):
        assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


@pytest.fixture
def op_by_op_lines(caplog):
    """Reads what was logged about running op by op ("pagedllm" does not propagate to the root
    logger, where caplog listens)."""
    logger = logging.getLogger(LOGGER_NAME)
    logger.addHandler(caplog.handler)
    yield lambda: [r.getMessage() for r in caplog.records if "op by op" in r.getMessage()]
    logger.removeHandler(caplog.handler)


def test_a_model_the_stack_cannot_take_says_why_once(head64_models, op_by_op_lines, monkeypatch):
    """fp32 weights left plain (as where the blocked kernel is not taken): F.linear has no kernel
    in the stack, and the engine's log says so once."""
    monkeypatch.setattr(linear, "_blocked_kernel_takes", lambda weight: False)
    llm = LLM(head64_models["llama"], dtype="float32", kv_cache_memory="16MiB")
    lines = op_by_op_lines()
    reason = "with UnquantizedLinearMethod) has no kernel" if cpu_ops() is not None else "C++ kernels are unavailable"
    assert llm.engine.model_runner.model.stack is None and len(lines) == 1 and reason in lines[0], lines


@needs_stack
def test_a_layer_part_without_a_stack_kernel_says_why_once(op_by_op_lines):
    """A layer's kernel_spec comes from its parts': a GELU-gated MLP has none, and the log says so
    once for the model (its layer type), naming the MLP."""
    from pagedllm.layers.activation import gelu_tanh_and_mul

    model = Qwen2ForCausalLM(_config("qwen2", 256, **_SHAPE), 64).bfloat16()
    for layer in model.model.layers:
        layer.mlp.activation = gelu_tanh_and_mul
    linear.process_linear_weights(model)
    model.bind_kernels()
    lines = op_by_op_lines()
    assert model.stack is None and len(lines) == 1 and "SiLU-gated MLPs only" in lines[0], lines


class _PlainOnly(linear.UnquantizedLinearMethod):
    """Plain weights even in bf16: never handed to the packed method, so no kernel_spec."""

    def process_weights_after_loading(self, layer: linear.Linear) -> None:
        pass


class _Everywhere(QuantizationConfig):
    """One method for every linear layer."""

    def __init__(self, method: linear.LinearMethodBase) -> None:
        self.method = method

    def linear_method(self, names: list[str]) -> linear.LinearMethodBase:
        return self.method


@needs_stack
@pytest.mark.parametrize("method", [None, _PlainOnly()])
def test_a_linear_method_without_a_stack_kernel_is_named_once(method, op_by_op_lines):
    """Two layers of four linear layers each: built with the packed method, the stack and no line;
    with a method that has no kernel there, one line naming the first layer and the method."""
    quant = _Everywhere(method) if method is not None else None
    model = Qwen2ForCausalLM(_config("qwen2", 256, **_SHAPE), 64, quant).bfloat16()
    linear.process_linear_weights(model)
    model.bind_kernels()
    lines = op_by_op_lines()
    if method is None:
        assert model.stack is not None and not lines, lines
    else:
        assert model.stack is None and len(lines) == 1, lines
        assert "model.layers.0.self_attn.qkv_proj (QKVLinear with _PlainOnly)" in lines[0]


@needs_stack
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("family", ["gpt-oss", "qwen3_moe"])
def test_stack_runs_moe_layers_as_the_op_by_op_path(family, dtype, tmp_path, tokenizer_dir, monkeypatch):
    """Mixture-of-experts layers in the stack, their MLP kernels/moe.cpp's one call: gpt-oss's
    sinks, q/k/v/o biases and its sliding and full layers in two KV groups (block tables of their
    own, cut to a piece's sequences as group 0's), Qwen3-MoE's per-head q/k norms with a dense
    layer among the sparse ones; the same tokens, logprobs and KV caches as op by op, to the bit."""
    monkeypatch.setattr(decoder, "PIECE_ROWS", 24)
    from test_moe import make_moe
    from test_more_families import make_gpt_oss

    folder = make_gpt_oss(tmp_path, tokenizer_dir) if family == "gpt-oss" else make_moe(family, tmp_path, tokenizer_dir)
    _assert_stack_is_op_by_op(folder, dtype, seed=5)
