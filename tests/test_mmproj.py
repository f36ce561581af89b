"""llama.cpp's vision projector files (mmproj) beside a GGUF text model: tests/data's Gemma 3
projector, made by llama.cpp's own converter (tests/data/make_mmproj.py) from vlm_utils' tiny
Gemma 3 tower, with the text model written as GGUF, held to transformers on the Hugging Face folder
both came from."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedllm import LLM, SamplingParams
from vlm_utils import GEMMA3_IMAGE, MAX_TOKENS, hf_greedy, load_hf_gemma3, make_gemma3_vl, picture

MMPROJ = str(Path(__file__).parent / "data" / "gemma3-tiny-mmproj-f32.gguf")
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


@pytest.fixture(scope="module")
def gemma3_gguf(tmp_path_factory, tokenizer_dir):
    """(the Hugging Face folder, transformers on it, its text model as a GGUF file)."""
    from transformers import Gemma3ForCausalLM

    from gguf_writer import write_gguf

    tmp = tmp_path_factory.mktemp("gemma3_gguf")
    folder = make_gemma3_vl(tmp / "hf", tokenizer_dir, **GGUF_TEXT)
    hf = load_hf_gemma3(folder)
    text = Gemma3ForCausalLM(hf[0].config.text_config)
    text.model.load_state_dict(hf[0].model.language_model.state_dict())
    text.config.architectures = ["Gemma3ForCausalLM"]
    text.save_pretrained(tmp / "text")
    write_gguf(str(tmp / "text"), str(tmp / "text.gguf"), "F32", folder)
    return folder, hf, str(tmp / "text.gguf")


def test_the_projector_file_holds_the_tiny_towers_weights(gemma3_gguf):
    """tests/data's file was converted from the tower vlm_utils makes (else remake it with
    tests/data/make_mmproj.py: torch or transformers changed how the tiny model comes out)."""
    from safetensors.torch import load_file

    from pagedllm.models.mmproj import iter_mmproj_weights

    folder, _, _ = gemma3_gguf
    theirs = {k: v for k, v in load_file(f"{folder}/model.safetensors").items() if not k.startswith("language_model")}
    ours = dict(iter_mmproj_weights(MMPROJ))
    assert set(ours) == set(theirs)
    for name, tensor in theirs.items():
        # (exact but the Gemma norm, stored plus 1: one fp32 rounding near 1)
        torch.testing.assert_close(ours[name], tensor, atol=1.2e-7, rtol=0, msg=name)


def test_gguf_text_and_mmproj_equal_transformers_on_the_folder(gemma3_gguf):
    _, hf, text_gguf = gemma3_gguf
    llm = LLM(text_gguf, mmproj=MMPROJ, dtype="float32", max_model_len=256, block_size=4, max_num_batched_tokens=8)
    prompts = [
        (f"Hi {GEMMA3_IMAGE} what is it?", [picture(1, (40, 90))]),
        (f"Hi {GEMMA3_IMAGE} what is it?", [picture(4, (40, 90))]),
        (f"{GEMMA3_IMAGE}{GEMMA3_IMAGE} compare", [picture(2), picture(3, (60, 60))]),
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


def test_a_projector_file_where_it_does_not_belong_is_refused_at_start(gemma3_gguf, llama_dir):
    folder, _, text_gguf = gemma3_gguf
    with pytest.raises(ValueError, match="a projector file beside a GGUF model file"):
        LLM(folder, mmproj=MMPROJ)
    with pytest.raises(ValueError, match="not a vision projector"):
        LLM(text_gguf, mmproj=text_gguf)
