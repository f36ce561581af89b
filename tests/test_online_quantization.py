"""--quantization int8 / int4 / int4_g32: a Hugging Face checkpoint's linear layers quantized as it
loads, onto the same kernels as GGUF's."""

from __future__ import annotations

import pytest
import torch

from conftest import WIDE, make_model, prompts_of_mixed_lengths, teacher_forced
from pagedllm import LLM, SamplingParams
from pagedllm.kernels import cpu_ops
from pagedllm.layers.quantization.formats import dequantize, quantize_int4_groups, quantize_int8_rows

ops = cpu_ops()
needs_kernels = pytest.mark.skipif(ops is None, reason="quantized weights need the C++ kernels")


def test_int8_per_channel():
    w = torch.randn(40, 96) * torch.logspace(-2, 1, 40)[:, None]  # rows of very different scales
    fields = quantize_int8_rows(w)
    assert fields.format.name == "Q8_0"
    d = torch.from_numpy(fields.scale.astype("float32"))
    assert (d == d[:, :1]).all()  # one scale a row
    error = (dequantize(fields) - w).abs()
    assert (error <= d[:, :1] / 2 * 1.0001).all()
    assert error.max() > 0


@pytest.mark.parametrize("group", [32, 128])
def test_int4_groups(group):
    w = torch.randn(24, 256) + torch.linspace(-3, 3, 256)  # an offset that moves along the row
    fields = quantize_int4_groups(w, group)
    assert fields.format.name == "Q4_1"
    d = torch.from_numpy(fields.scale.astype("float32"))
    assert (d.view(24, -1, group // 32) == d.view(24, -1, group // 32)[..., :1]).all()  # shared by the group
    error = (dequantize(fields) - w).abs()
    # half a step, plus the float16 rounding of the minimum and of the scale over 15 steps
    bound = d.repeat_interleave(32, dim=1) * 0.51 + w.abs().max() * 2**-10
    assert (error <= bound).all()
    with pytest.raises(ValueError, match="does not divide"):
        quantize_int4_groups(torch.randn(4, 96), 128)


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory, tokenizer_dir) -> str:
    return make_model("llama", tmp_path_factory.mktemp("wide-llama"), tokenizer_dir, **WIDE)


@needs_kernels
@pytest.mark.parametrize("scheme, bound, worst", [("int8", 0.05, 0.1), ("int4_g32", 0.35, 1.0), ("int4", 0.4, 1.2)])
def test_online_quantization_near_the_float_model(wide_llama, scheme, bound, worst):
    """Teacher-forced on mixed-length prompts, fp32: each position's logprob of the next token within
    the scheme's rounding of the unquantized model's. Measured mean (max) |delta|: int8 0.018
    (0.057), int4_g32 0.165 (0.57), int4 0.181 (0.76); for scale, the same model written as a Q4_1
    GGUF by the gguf package's own quantizer (embedding included) gives 0.27 (1.21), either
    dequantized or quantized. The embedding and head stay float."""
    quantized = LLM(wide_llama, dtype="float32", quantization=scheme, kv_cache_memory="32MiB")
    model = quantized.engine.model_runner.model
    assert model.model.layers[0].mlp.gate_up_proj.formats == (scheme,)
    assert not hasattr(model.lm_head, "formats") and isinstance(model.model.embed_tokens, torch.nn.Embedding)
    plain = LLM(wide_llama, dtype="float32", kv_cache_memory="32MiB")
    sequences = [s for s in prompts_of_mixed_lengths(model.decoder_config.vocab_size, seed=3) if len(s) > 1]
    delta = (teacher_forced(quantized, sequences) - teacher_forced(plain, sequences)).abs()
    print(f"{scheme}: mean {delta.mean():.4f} max {delta.max():.4f}")
    assert delta.mean() < bound and delta.max() < worst


@needs_kernels
def test_online_quantized_layers_run_in_the_stack(wide_llama):
    llm = LLM(wide_llama, quantization="int4", kv_cache_memory="32MiB", dtype="bfloat16")
    assert llm.engine.model_runner.model.stack is not None
    out = llm.generate(
        [{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 4


def test_bad_quantization_choices(wide_llama):
    from pagedllm.models.loader import default_model_path

    with pytest.raises(ValueError, match="unknown quantization 'int3'"):
        LLM(wide_llama, quantization="int3")
    with pytest.raises(ValueError, match="needs a .gguf model file"):
        LLM(wide_llama, quantization="gguf")
    with pytest.raises(ValueError, match="a GGUF file keeps its own types"):
        LLM(default_model_path(), quantization="int8")
