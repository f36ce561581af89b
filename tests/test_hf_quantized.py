"""AWQ, GPTQ and compressed-tensors checkpoints, repacked at load onto the quantized kernels: each
layout unpacked equal to its own package's dequantization (tests/hf_checkpoints.py), the records
within their float16 rounding of it, and whole models near a float folder of those dequantized
weights."""

from __future__ import annotations

import logging

import pytest
import torch

from conftest import WIDE, make_model, prompts_of_mixed_lengths, teacher_forced
from hf_checkpoints import awq, compressed, compressed_config, compressed_scheme, gptq, quantize_folder
from pagedllm import LLM, SamplingParams
from pagedllm.kernels import cpu_ops
from pagedllm.layers.quantization.checkpoint import GroupQuant, checkpoint_quant_config, to_fields
from pagedllm.layers.quantization.formats import dequantize

pytest.importorskip("compressed_tensors")
needs_kernels = pytest.mark.skipif(cpu_ops() is None, reason="quantized weights need the C++ kernels")
AWQ_CONFIG = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}


def gptq_config(bits: int, sym: bool, act_order: bool) -> dict:
    return {"quant_method": "gptq", "bits": bits, "group_size": 128, "desc_act": act_order, "sym": sym}


def weights(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(96, 256, generator=g) * 0.05 + torch.linspace(-0.05, 0.05, 256)  # an offset along the row


def records_in_input_order(quant: GroupQuant) -> tuple[torch.Tensor, str]:
    fields, perm = to_fields(quant)
    values = dequantize(fields)
    return (values if perm is None else values[:, torch.argsort(perm)]), fields.format.name


def check_records(quant: GroupQuant, oracle: torch.Tensor, runs_as: str) -> None:
    """The records' weights: the oracle's exactly where they keep its float16 scales (symmetric
    layouts); with zero points (Q4_1's minimum m = -z s in float16), within half a float16 step of
    z s; float32 scales rounded to float16, within 2^-11 of each weight."""
    values, name = records_in_input_order(quant)
    assert name == runs_as
    z = 2 ** (quant.bits - 1) if quant.zeros is None else quant.zeros[:, quant.group_of].float()
    bound = (z * quant.scales.float()[:, quant.group_of]).abs() * 2**-11 if name == "Q4_1" else 0
    if quant.scales.dtype != torch.float16:
        bound = bound + oracle.abs() * 2**-11
    assert ((values - oracle).abs() <= bound * 1.0001).all()


def test_awq_layout():
    tensors, oracle = awq(weights())
    quant = checkpoint_quant_config(AWQ_CONFIG).scheme.unpack(tensors)
    assert torch.equal(quant.dequantize(), oracle)
    check_records(quant, oracle, "Q4_1")


@pytest.mark.parametrize(
    "bits, sym, act_order, runs_as",
    [
        (4, True, False, "Q4_0"),
        (4, True, True, "Q4_0"),
        (4, False, False, "Q4_1"),
        (4, False, True, "Q4_1"),
        (8, True, False, "Q8_0"),
        (8, True, True, "Q8_0"),
    ],
)
def test_gptq_layout(bits, sym, act_order, runs_as):
    tensors, oracle = gptq(weights(), bits, sym, act_order)
    quant = checkpoint_quant_config(gptq_config(bits, sym, act_order)).scheme.unpack(tensors)
    assert torch.equal(quant.dequantize(), oracle)
    check_records(quant, oracle, runs_as)
    assert (to_fields(quant)[1] is not None) == act_order


@pytest.mark.parametrize(
    "bits, symmetric, strategy, group, activations, form, runs_as",
    [
        (4, True, "group", 128, False, "pack-quantized", "Q4_0"),  # W4A16
        (4, False, "group", 32, False, "pack-quantized", "Q4_1"),
        (4, True, "channel", None, False, "pack-quantized", "Q4_0"),
        (8, True, "channel", None, True, "int-quantized", "Q8_0"),  # W8A8
        (8, True, "group", 64, False, "pack-quantized", "Q8_0"),  # W8A16
    ],
)
def test_compressed_tensors_layout(bits, symmetric, strategy, group, activations, form, runs_as):
    scheme = compressed_scheme(bits, symmetric, strategy, group, activations)
    tensors, oracle = compressed(weights(), scheme)
    quant = checkpoint_quant_config(compressed_config(scheme, form)).scheme.unpack(tensors)
    assert torch.equal(quant.dequantize(), oracle)
    check_records(quant, oracle, runs_as)


def test_unsupported_configs_are_refused_by_name():
    cases = [
        ({"quant_method": "bitsandbytes"}, "quantized by 'bitsandbytes'"),
        ({"quant_method": "mxfp4"}, "quantized by 'mxfp4'"),  # gpt-oss's release
        ({**AWQ_CONFIG, "version": "gemv"}, "version 'gemv'"),
        ({**AWQ_CONFIG, "group_size": 100}, "group_size 100"),
        ({**gptq_config(3, True, False)}, "bits 3"),
        ({**gptq_config(4, True, False), "checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
        (compressed_config(compressed_scheme(4, True, "group", 128, False), "marlin-24"), "format 'marlin-24'"),
    ]
    for spec, message in cases:
        with pytest.raises(ValueError, match=message):
            checkpoint_quant_config(spec)
    with pytest.raises(ValueError, match="asymmetric 8-bit"):
        tensors, _ = gptq(weights(), 8, False, False)
        to_fields(checkpoint_quant_config(gptq_config(8, False, False)).scheme.unpack(tensors))


# -- whole models ---------------------------------------------------------------------------------
FOLDERS = {
    "awq": (lambda w: awq(w), AWQ_CONFIG, "AWQ-int4 as Q4_1"),
    "gptq-int4": (lambda w: gptq(w, 4, True, False), gptq_config(4, True, False), "GPTQ-int4 as Q4_0"),
    "gptq-int8-act-order": (
        lambda w: gptq(w, 8, True, True),
        gptq_config(8, True, True),
        "GPTQ-int8-act-order as Q8_0",
    ),
    "w8a8": (
        lambda w: compressed(w, compressed_scheme(8, True, "channel", None, True)),
        compressed_config(compressed_scheme(8, True, "channel", None, True), "int-quantized"),
        "W8A8-int8 as Q8_0",
    ),
    "w4a16-asym": (
        lambda w: compressed(w, compressed_scheme(4, False, "group", 128, False)),
        compressed_config(compressed_scheme(4, False, "group", 128, False), "pack-quantized"),
        "W4A16-int4 as Q4_1",
    ),
}


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory, tokenizer_dir) -> str:
    return make_model("llama", tmp_path_factory.mktemp("wide-llama"), tokenizer_dir, **WIDE)


@pytest.fixture(scope="module", params=list(FOLDERS))
def folders(request, tmp_path_factory, wide_llama) -> tuple[str, str, str, str]:
    """(format, the quantized folder, a float folder of the oracle's dequantized weights, the log's label)."""
    quantize, config, label = FOLDERS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    quantize_folder(wide_llama, str(root / "quantized"), str(root / "dequantized"), quantize, config)
    return request.param, str(root / "quantized"), str(root / "dequantized"), label


@needs_kernels
def test_quantized_folder_near_its_dequantized_weights(folders, caplog):
    """Teacher-forced on mixed-length prompts, fp32: each position's logprob within the kernels'
    int8 activations (and Q4_1's float16 minimums) of the same weights in float; the log says what
    each layer runs as; lm_head and the embedding stay float."""
    name, quantized, dequantized, label = folders
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        llm = LLM(quantized, dtype="float32", kv_cache_memory="32MiB")
    model = llm.engine.model_runner.model
    assert llm.engine.model_config.quantization == FOLDERS[name][1]["quant_method"]
    assert model.model.layers[0].mlp.gate_up_proj.formats == (label,)
    assert model.model.layers[1].self_attn.o_proj.formats == (label,)
    assert not hasattr(model.lm_head, "formats") and isinstance(model.model.embed_tokens, torch.nn.Embedding)
    assert f"qkv_proj {label} x 2" in caplog.text
    assert (model.stack is None) == name.endswith("act-order")
    plain = LLM(dequantized, dtype="float32", kv_cache_memory="32MiB")
    sequences = [s for s in prompts_of_mixed_lengths(model.decoder_config.vocab_size, seed=5) if len(s) > 1]
    delta = (teacher_forced(llm, sequences) - teacher_forced(plain, sequences)).abs()
    print(f"{name}: mean {delta.mean():.4f} max {delta.max():.4f}")
    assert delta.mean() < 0.04 and delta.max() < 0.3


@needs_kernels
def test_quantization_flag_against_a_quantized_folder(tmp_path, wide_llama):
    quantize_folder(wide_llama, str(tmp_path / "q"), str(tmp_path / "d"), lambda w: awq(w), AWQ_CONFIG)
    with pytest.raises(ValueError, match="awq-quantized .* --quantization int8 cannot load it"):
        LLM(str(tmp_path / "q"), quantization="int8")
    with pytest.raises(ValueError, match="needs a checkpoint quantized by it"):
        LLM(wide_llama, quantization="gptq")
    llm = LLM(str(tmp_path / "q"), quantization="awq", kv_cache_memory="16MiB")
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


@needs_kernels
def test_a_quantized_folder_splits_over_two_ranks(llama_dir, tmp_path):
    """GPTQ 4-bit with zero points in groups of 32 on the tiny Llama: each rank's rows (q/k/v, gate/up)
    and its input columns in whole blocks (o_proj: 2 heads of 16, down_proj: 64 features) give one
    rank's greedy tokens; act-order is refused at start-up, before any rank starts."""
    config = {**gptq_config(4, False, False), "group_size": 32}
    quantize_folder(llama_dir, str(tmp_path / "q"), str(tmp_path / "d"), lambda w: gptq(w, 4, False, False, 32), config)
    args = dict(dtype="float32", max_model_len=256, kv_cache_memory="16MiB")
    prompts = prompts_of_mixed_lengths(49152)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def greedy(llm: LLM) -> list[list[int]]:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    llm = LLM(str(tmp_path / "q"), tensor_parallel_size=2, **args)
    assert greedy(llm) == greedy(LLM(str(tmp_path / "q"), **args))
    llm.engine.shutdown()
    act_order = {**config, "desc_act": True}
    quantize_folder(
        llama_dir, str(tmp_path / "a"), str(tmp_path / "ad"), lambda w: gptq(w, 4, False, True, 32), act_order
    )
    with pytest.raises(ValueError, match="activation order .* does not split over tensor-parallel ranks"):
        LLM(str(tmp_path / "a"), tensor_parallel_size=2, **args)
