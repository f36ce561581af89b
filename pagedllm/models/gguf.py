"""GGUF files: metadata to a Hugging Face config, tensors dequantized and renamed to HF names."""
from __future__ import annotations

import functools
import os
import re
from collections.abc import Iterator

import numpy as np
import torch

# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.").
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
# llama.cpp's converter interleaves Q/K rows for its rotary layout on these architectures only.
_PERMUTED_ARCHS = {"llama", "mistral"}
SUPPORTED_ARCHS = {"llama", "mistral", "qwen2", "qwen3"}


@functools.lru_cache(maxsize=4)
def _reader(path: str):
    """Parsed once per file: parsing a large vocabulary's metadata takes seconds."""
    import gguf

    try:
        return gguf.GGUFReader(path)
    except Exception as exc:  # the reader raises many types on a damaged file
        raise ValueError(f"{path} is not a readable GGUF file: {exc}") from exc


def gguf_architecture(path: str) -> str:
    reader = _reader(path)
    field = reader.fields.get("general.architecture")
    if field is None:
        raise ValueError(f"{path}: GGUF metadata has no general.architecture")
    return field.contents()


def load_gguf_config(path: str):
    """A transformers config built from the GGUF metadata (transformers reads the keys)."""
    arch = gguf_architecture(path)
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported (supported: {sorted(SUPPORTED_ARCHS)})")
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(os.path.dirname(path) or ".", gguf_file=os.path.basename(path))
    reader = _reader(path)
    # Keys transformers' GGUF mapping leaves out but the model depends on.
    head_dim = _field(reader, f"{arch}.attention.key_length")
    if head_dim:
        config.head_dim = int(head_dim)
    window = _field(reader, f"{arch}.attention.sliding_window")
    if window:
        config.sliding_window = int(window)
    config.tie_word_embeddings = not any(t.name == "output.weight" for t in reader.tensors)
    return config


def _field(reader, key: str):
    field = reader.fields.get(key)
    return field.contents() if field is not None else None


def load_gguf_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(path) or ".", gguf_file=os.path.basename(path))


def iter_gguf_weights(path: str, config) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 tensor) for every tensor of the file, Q/K rows un-permuted."""
    import gguf

    reader = _reader(path)
    arch = gguf_architecture(path)
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dims innermost first
        data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        weight = torch.from_numpy(np.array(data, dtype=np.float32)).reshape(shape)
        if arch in _PERMUTED_ARCHS and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            weight = unpermute_qk(weight, heads)
        yield name, weight


def num_tensors(path: str) -> int:
    return len(_reader(path).tensors)


def hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if not match or match.group(2) not in _LAYER_NAMES:
        raise ValueError(f"unknown GGUF tensor {gguf_name!r}")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's row interleave: per head, rows (2, half) were stored as (half, 2)."""
    rows = weight.shape[0]
    return (weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape))
