"""The model registry and the families' options: each architecture its own class, on the shared decoder."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from conftest import ARCHS, _config
from pagedllm.models.interface import CausalLM
from pagedllm.models.registry import model_class

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


@pytest.mark.parametrize("family", ARCHS)
def test_each_architecture_resolves_to_its_own_family_class(family):
    by_name = model_class(SimpleNamespace(architectures=[_ARCHITECTURES[family]]))
    assert by_name.__module__ == f"pagedllm.models.{family}" and by_name.__name__ == _ARCHITECTURES[family]
    assert issubclass(by_name, CausalLM)
    # A GGUF file's config names no architecture: its model_type does.
    assert model_class(SimpleNamespace(architectures=None, model_type=family)) is by_name


def test_the_four_classes_are_distinct():
    assert len({model_class(SimpleNamespace(architectures=[name])) for name in _ARCHITECTURES.values()}) == 4


def test_an_unknown_architecture_is_refused_naming_it_and_the_supported_ones():
    supported = (
        "BertForSequenceClassification, BertModel, DeepseekV2ForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM, "
        "Gemma3ForConditionalGeneration, GptOssForCausalLM, GraniteForCausalLM, GraniteMoeForCausalLM, "
        "LlamaForCausalLM, "
        "LlavaForConditionalGeneration, "
        "MistralForCausalLM, MixtralForCausalLM, Olmo2ForCausalLM, "
        "Phi3ForCausalLM, Qwen2ForCausalLM, Qwen2MoeForCausalLM, Qwen2VLForConditionalGeneration, Qwen3ForCausalLM, "
        "Qwen3MoeForCausalLM, SmolLM3ForCausalLM"
    )
    with pytest.raises(
        ValueError,
        match=r"unsupported model architecture \['GPT2LMHeadModel'\]; supported: " + re.escape(supported) + "$",
    ):
        model_class(SimpleNamespace(architectures=["GPT2LMHeadModel"], model_type="gpt2"))


@pytest.mark.parametrize(
    "family, qkv_bias, qk_norm, window",
    [
        ("llama", False, False, None),
        ("mistral", False, False, 8),
        ("qwen2", True, False, None),
        ("qwen3", False, True, None),
    ],
)
def test_each_family_builds_its_options_into_the_shared_layers(family, qkv_bias, qk_norm, window):
    config = _config(family, 256)
    with torch.device("meta"):
        model = model_class(config)(config, 64)
    attn = model.model.layers[0].self_attn
    assert (attn.qkv_proj.bias is not None) == qkv_bias and attn.o_proj.bias is None
    assert attn.qk_norm == qk_norm and hasattr(attn, "q_norm") == qk_norm
    assert [layer.self_attn.sliding_window for layer in model.model.layers] == [window] * config.num_hidden_layers
