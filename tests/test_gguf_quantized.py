"""GGUF files computed on as they are stored (quantized): each layer in its tensors' types, the
same distributions as the file dequantized to within int8 activation rounding, the fused decoder
stack bit for bit against the op-by-op path, the start-up log, and a clear error for a type the
kernels do not take."""

from __future__ import annotations

import logging

import pytest
import torch

from conftest import WIDE, hf_greedy, make_model, prompts_of_mixed_lengths
from gguf_writer import write_gguf
from pagedllm import LLM, SamplingParams
from pagedllm.kernels import cpu_ops
from pagedllm.layers.quantization.gguf import GGUFConfig, QuantizedEmbedding, TiedHead
from pagedllm.logger import LOGGER_NAME
from pagedllm.models import decoder

ops = cpu_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="quantized weights need the C++ kernels")
Q4_K_M = {"attn_v": "Q6_K", "ffn_down": "Q6_K", "output.weight": "Q6_K"}  # as llama.cpp's Q4_K_M mixes them


@pytest.fixture(scope="module")
def wide_models(tmp_path_factory, tokenizer_dir) -> dict[str, str]:
    return {
        arch: make_model(arch, tmp_path_factory.mktemp(f"wide-{arch}"), tokenizer_dir, **WIDE)
        for arch in ("llama", "qwen2")
    }


def gguf_file(tmp_path, hf_dir: str, qtype: str, overrides=None) -> str:
    """A GGUF file of `hf_dir` without a tokenizer (the engines here take the tokenizer folder's:
    writing and reading the GGUF's 49k entries took a few seconds a file)."""
    folder = tmp_path / qtype
    folder.mkdir()
    path = str(folder / "model.gguf")
    write_gguf(hf_dir, path, qtype, None, overrides)
    return path


def teacher_forced(llm: LLM, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Each sequence's logprobs of its own next tokens, from the prompt pass."""
    outputs = llm.generate(
        [{"prompt_token_ids": s} for s in sequences], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False
    )
    return [
        torch.tensor([entry[t].logprob for entry, t in zip(o.prompt_logprobs[1:], s[1:])])
        for o, s in zip(outputs, sequences)
    ]


@pytest.mark.parametrize(
    "arch, qtype, overrides",
    [
        ("qwen2", "Q8_0", None),
        ("llama", "Q4_0", None),
        ("qwen2", "Q4_1", None),
        ("llama", "Q5_0", None),
        ("qwen2", "Q5_1", None),
        ("llama", "Q4_K", Q4_K_M),
        ("qwen2", "Q5_K", {"ffn_down": "Q6_K"}),
        ("llama", "Q2_K", {"attn_v": "Q3_K", "ffn_down": "Q3_K"}),  # as llama.cpp's Q2_K mixes them
        ("qwen2", "Q3_K", None),
        ("llama", "IQ4_NL", None),
        ("qwen2", "IQ4_XS", {"attn_v": "IQ4_NL"}),
        ("llama", "MXFP4", None),
        ("qwen2", "IQ3_S", None),
    ],
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_quantized_layers_give_the_dequantized_distributions(
    tmp_path, wide_models, tokenizer_dir, arch, qtype, overrides, dtype
):
    """The same file computed on quantized and dequantized at load: the layers carry the file's
    types (a fused q/k/v of Q4_K and Q6_K shards included), and each position's logprob of the
    next token differs only by the activations' int8 rounding (teacher-forced, mixed lengths)."""
    path = gguf_file(tmp_path, wide_models[arch], qtype, overrides)
    quantized = LLM(path, tokenizer=tokenizer_dir, dtype=dtype, kv_cache_memory="32MiB", max_num_batched_tokens=64)
    model = quantized.engine.model_runner.model
    layer = model.model.layers[0]
    assert layer.mlp.gate_up_proj.formats == (qtype,)
    expected_qkv = (qtype, overrides["attn_v"]) if overrides and "attn_v" in overrides else (qtype,)
    assert layer.self_attn.qkv_proj.formats == expected_qkv
    assert layer.mlp.down_proj.formats == ((overrides or {}).get("ffn_down", qtype),)
    assert isinstance(model.model.embed_tokens, QuantizedEmbedding)
    assert isinstance(model.lm_head, TiedHead) == (arch == "llama")
    dequantized = LLM(path, tokenizer=tokenizer_dir, dtype=dtype, kv_cache_memory="32MiB", quantization="none")
    sequences = [s for s in prompts_of_mixed_lengths(model.decoder_config.vocab_size, seed=2) if len(s) > 1]
    delta = (torch.cat(teacher_forced(quantized, sequences)) - torch.cat(teacher_forced(dequantized, sequences))).abs()
    print(f"{arch} {qtype} {dtype}: mean {delta.mean():.4f} max {delta.max():.4f} over {len(delta)}")
    assert delta.mean() < 0.04 and delta.max() < 0.3, (delta.mean(), delta.max())


class _CountingStack:
    """The model's C++ stack, counting the steps it takes."""

    def __init__(self, stack) -> None:
        self.stack, self.steps = stack, 0

    def forward(self, *args):
        self.steps += 1
        return self.stack.forward(*args)


@pytest.mark.parametrize("qtype, overrides", [("Q4_K", Q4_K_M), ("Q8_0", None)])
@pytest.mark.parametrize("stack", [True, False])
def test_mlp_in_chunks_changes_no_result(tmp_path, wide_models, tokenizer_dir, qtype, overrides, stack, monkeypatch):
    """A long step's MLP in chunks of rows (decoder.MLP_ROWS, here 16 of a 48-token step) gives each
    row what the whole step's MLP gives, bit for bit, by the stack and op by op."""
    path = gguf_file(tmp_path, wide_models["llama"], qtype, overrides)

    def run(mlp_rows: int) -> list:
        monkeypatch.setattr(decoder, "MLP_ROWS", mlp_rows)
        llm = LLM(path, tokenizer=tokenizer_dir, dtype="bfloat16", kv_cache_memory="32MiB", max_num_batched_tokens=48)
        if not stack:
            llm.engine.model_runner.model.stack = None
        prompts = prompts_of_mixed_lengths(len(llm.get_tokenizer()), seed=7)
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=2),
            use_tqdm=False,
        )
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs) for o in outputs]

    assert run(16) == run(512)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_stack_takes_quantized_layers_bit_for_bit(tmp_path, wide_models, tokenizer_dir, dtype, monkeypatch):
    """Quantized layers: the fused decoder stack runs and gives what the op-by-op path gives, bit
    for bit, through chunked prefill and decode (Q4_K_M's mix), the MLP of longer steps in chunks
    of 16 rows in both; every step goes by the stack, fresh prompts included."""
    monkeypatch.setattr(decoder, "MLP_ROWS", 16)
    path = gguf_file(tmp_path, wide_models["llama"], "Q4_K", Q4_K_M)
    stacked, op_by_op = (
        LLM(path, tokenizer=tokenizer_dir, dtype=dtype, kv_cache_memory="32MiB", max_num_batched_tokens=48)
        for _ in range(2)
    )
    model = stacked.engine.model_runner.model
    assert model.stack is not None
    model.stack = counting = _CountingStack(model.stack)
    op_by_op.engine.model_runner.model.stack = None

    def op_by_op_layer(*args):
        raise AssertionError("a step went op by op")

    model.model.layers[0].forward = op_by_op_layer  # every step by the stack, prompts computed whole too
    prompts = prompts_of_mixed_lengths(len(stacked.get_tokenizer()), seed=5)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)

    def run(llm):
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]

    assert run(stacked) == run(op_by_op)
    assert counting.steps >= 11  # the decode steps at least


def test_start_up_log_names_the_types(tmp_path, wide_models, tokenizer_dir, caplog):
    path = gguf_file(tmp_path, wide_models["qwen2"], "Q4_K", Q4_K_M)
    logging.getLogger(LOGGER_NAME).addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger=LOGGER_NAME):
            LLM(path, tokenizer=tokenizer_dir, kv_cache_memory="32MiB")
    finally:
        logging.getLogger(LOGGER_NAME).removeHandler(caplog.handler)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("Weights: "))
    assert "qkv_proj Q4_K+Q6_K x 2" in line and "down_proj Q6_K x 2" in line and "lm_head Q6_K" in line
    assert "embed_tokens Q4_K" in line and line.endswith(" MiB")


def test_unsupported_types_are_named():
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.up_proj.weight is of type IQ2_XXS.*supported: F32"):
        GGUFConfig({"model.layers.0.mlp.up_proj.weight": "IQ2_XXS"})
    config = GGUFConfig({"a.q_proj.weight": "Q4_0", "a.k_proj.weight": "F16", "a.v_proj.weight": "Q4_0"})
    with pytest.raises(ValueError, match=r"a.k_proj \(F16\).*mix quantized and float"):
        config.linear_method(["a.q_proj", "a.k_proj", "a.v_proj"])
    assert config.linear_method(["a.k_proj"]) is None  # float tensors: the unquantized method


def test_default_model_quantized_near_transformers(default_hf_model):
    """SmolLM2's Q4_1 file computed on quantized (the default): teacher-forced on transformers'
    greedy continuations, the next token's logprob within int8 activation rounding of transformers'
    (which dequantizes the file, fp32), and its most likely token nearly always transformers'.
    Measured: mean |delta| 0.038 (fp32) and 0.055 (bf16, the default), max 0.40 and 0.45, top-1
    agreement 98.3% and 99.2%, over 121 positions."""
    hf = default_hf_model
    llm = LLM(kv_cache_memory="256MiB", max_model_len=2048)
    assert llm.engine.model_config.quantization == "gguf"
    tokenizer = llm.get_tokenizer()
    texts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, in a land far away, there lived a dragon who " * 4,
    ]
    deltas, agree = [], []
    for text in texts:
        prompt = tokenizer.encode(text)
        sequence = prompt + hf_greedy(hf, prompt, 16)[0]
        with torch.no_grad():
            reference = torch.log_softmax(hf(torch.tensor([sequence])).logits[0].float(), dim=-1)
        output = llm.generate(
            [{"prompt_token_ids": sequence}], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False
        )[0]
        for i, entry in enumerate(output.prompt_logprobs[1:]):
            deltas.append(abs(entry[sequence[i + 1]].logprob - reference[i, sequence[i + 1]].item()))
            agree.append(next(t for t, lp in entry.items() if lp.rank == 1) == reference[i].argmax().item())
    deltas = torch.tensor(deltas)
    assert deltas.mean() < 0.1 and deltas.max() < 1.0, (deltas.mean(), deltas.max())
    assert sum(agree) / len(agree) >= 0.95
