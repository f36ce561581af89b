"""llama.cpp's vision projector files (mmproj) beside a GGUF text model: tests/data's projectors
(Gemma 3's, Qwen2-VL's), made by llama.cpp's own converter (tests/data/make_mmproj.py) from
vlm_utils' tiny towers, with the text model written as GGUF, held to transformers on the Hugging
Face folder both came from."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedllm import LLM, SamplingParams
from vlm_utils import (
    GEMMA3_IMAGE,
    MAX_TOKENS,
    QWEN2_VL_IMAGE,
    hf_greedy,
    load_hf_gemma3,
    load_hf_qwen2_vl,
    make_gemma3_vl,
    make_qwen2_vl,
    picture,
)

DATA = Path(__file__).parent / "data"
# What a GGUF file can say of Gemma 3's text model: the default pattern of sliding and full layers,
# query_pre_attn_scalar and rotary bases (test_gemma3's GGUF test).
GGUF_TEXT = {
    "num_hidden_layers": 6,
    "layer_types": None,
    "query_pre_attn_scalar": 256,
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
    },
}


def _gemma3_text(hf):
    from transformers import Gemma3ForCausalLM

    text = Gemma3ForCausalLM(hf.config.text_config)
    text.model.load_state_dict(hf.model.language_model.state_dict())
    return text


def _qwen2_vl_text(hf):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    settings = {k: v for k, v in hf.config.text_config.to_dict().items() if k not in ("model_type", "architectures")}
    text = Qwen2ForCausalLM(Qwen2Config(**settings))  # (M-RoPE's sections in its rope_parameters)
    text.model.load_state_dict(hf.model.language_model.state_dict())
    text.lm_head.load_state_dict(hf.lm_head.state_dict())
    return text


# family -> (its folder's maker and overrides, transformers' loader, the text model alone, an image's placeholder)
FAMILIES = {
    "gemma3": (make_gemma3_vl, GGUF_TEXT, load_hf_gemma3, _gemma3_text, GEMMA3_IMAGE),
    "qwen2-vl": (make_qwen2_vl, {}, load_hf_qwen2_vl, _qwen2_vl_text, QWEN2_VL_IMAGE),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory, tokenizer_dir):
    """(the family, its Hugging Face folder, transformers on it, its text model as a GGUF file)."""
    from gguf_writer import write_gguf

    make, overrides, load, text_model, _ = FAMILIES[request.param]
    tmp = tmp_path_factory.mktemp(request.param)
    folder = make(tmp / "hf", tokenizer_dir, **overrides)
    hf = load(folder)
    text = text_model(hf[0])
    text.config.architectures = [type(text).__name__]
    text.save_pretrained(tmp / "text")
    write_gguf(str(tmp / "text"), str(tmp / "text.gguf"), "F32", folder)
    return request.param, folder, hf, str(tmp / "text.gguf")


def _mmproj(name: str) -> str:
    return str(DATA / f"{name}-tiny-mmproj-f32.gguf")


def test_the_projector_files_hold_the_tiny_towers_weights(family):
    """tests/data's files were converted from the towers vlm_utils makes (else remake them with
    tests/data/make_mmproj.py: torch or transformers changed how the tiny models come out)."""
    from safetensors.torch import load_file

    from pagedllm.models.mmproj import iter_mmproj_weights

    name, folder, _, _ = family
    theirs = {
        k.removeprefix("model."): v
        for k, v in load_file(f"{folder}/model.safetensors").items()
        if "language_model" not in k
        and k != "lm_head.weight"
        and not k.startswith("model.layers.")
        and k not in ("model.embed_tokens.weight", "model.norm.weight")
    }
    ours = dict(iter_mmproj_weights(_mmproj(name)))
    assert set(ours) == set(theirs)
    for tensor_name, tensor in theirs.items():
        # (exact but Gemma's norm, stored plus 1: one fp32 rounding near 1)
        torch.testing.assert_close(ours[tensor_name], tensor, atol=1.2e-7, rtol=0, msg=tensor_name)


def test_gguf_text_and_mmproj_equal_transformers_on_the_folder(family):
    name, _, hf, text_gguf = family
    image = FAMILIES[name][4]
    llm = LLM(
        text_gguf, mmproj=_mmproj(name), dtype="float32", max_model_len=256, block_size=4, max_num_batched_tokens=8
    )
    prompts = [
        (f"Hi {image} what is it?", [picture(1, (40, 90))]),
        (f"Hi {image} what is it?", [picture(4, (40, 90))]),
        (f"{image}{image} compare", [picture(2), picture(3, (60, 60))]),
    ]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outputs = llm.generate(
        [{"prompt": p, "multi_modal_data": {"image": images}} for p, images in prompts], params, use_tqdm=False
    )
    expected = [hf_greedy(hf, p, images) for p, images in prompts]
    assert expected[0][1] != expected[1][1]  # the image matters
    for output, (tokens, logprobs) in zip(outputs, expected, strict=True):
        sample = output.outputs[0]
        assert list(sample.token_ids) == tokens
        ours = [entry[t].logprob for entry, t in zip(sample.logprobs, sample.token_ids)]
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(logprobs), atol=1e-4, rtol=1e-4)


def test_a_projector_file_where_it_does_not_belong_is_refused_at_start(family):
    name, folder, _, text_gguf = family
    with pytest.raises(ValueError, match="a projector file beside a GGUF model file"):
        LLM(folder, mmproj=_mmproj(name))
    with pytest.raises(ValueError, match="not a vision projector"):
        LLM(text_gguf, mmproj=text_gguf)
    other = "qwen2-vl" if name == "gemma3" else "gemma3"
    with pytest.raises(ValueError, match="this projector goes with a"):
        LLM(text_gguf, mmproj=_mmproj(other))
