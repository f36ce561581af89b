"""llama.cpp's vision projector files (`mmproj`, GGUF of general.architecture "clip"), beside a
text model's GGUF file: the config of the vision-language model they make together, and the
projector file's tensors under the names our vision-language classes load. Projector types so
far: Gemma 3's."""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
import torch

from pagedllm.models.gguf import _reader, field_value

# The tower's per-layer tensors: llama.cpp's name -> SigLIP's, under vision_tower.encoder.layers.N.
_LAYER_NAMES = {
    "ln1": "layer_norm1",
    "ln2": "layer_norm2",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_out": "self_attn.out_proj",
    "ffn_up": "mlp.fc1",
    "ffn_down": "mlp.fc2",
}
_GEMMA3_NAMES = {
    "v.patch_embd": "vision_tower.embeddings.patch_embedding",
    "v.position_embd": "vision_tower.embeddings.position_embedding",
    "v.post_ln": "vision_tower.post_layernorm",
    "mm.input_projection": "multi_modal_projector.mm_input_projection",
    "mm.soft_emb_norm": "multi_modal_projector.mm_soft_emb_norm",
}
# The image tokens a Gemma 3 vocabulary holds: the one a prompt shows, the end, the soft tokens.
_GEMMA3_TOKENS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")


def projector_type(mmproj: str) -> str:
    reader = _reader(mmproj)
    if field_value(reader, "general.architecture") != "clip" or not field_value(reader, "clip.has_vision_encoder"):
        raise ValueError(f"{mmproj}: not a vision projector (mmproj) GGUF file")
    kind = str(field_value(reader, "clip.projector_type"))
    if kind != "gemma3":
        raise ValueError(f"{mmproj}: projector type {kind!r} is not supported (supported: gemma3)")
    return kind


def mmproj_config(text, text_path: str, mmproj: str):
    """The vision-language model's transformers config: the text file's config (`text`) and the
    projector file's vision settings; its image tokens' ids from the text file's vocabulary."""
    from transformers import Gemma3Config, SiglipVisionConfig

    if projector_type(mmproj) == "gemma3" and text.model_type != "gemma3_text":
        raise ValueError(f"{mmproj}: a Gemma 3 projector needs a Gemma 3 text model, not {text.model_type}")
    reader = _reader(mmproj)

    def value(key: str):
        found = field_value(reader, f"clip.vision.{key}")
        if found is None:
            raise ValueError(f"{mmproj}: the projector file lacks clip.vision.{key}")
        return found

    if int(value("projection_dim")) != text.hidden_size:
        raise ValueError(f"{mmproj}: projects to {value('projection_dim')} wide, the text model is {text.hidden_size}")
    vision = SiglipVisionConfig(
        hidden_size=int(value("embedding_length")),
        intermediate_size=int(value("feed_forward_length")),
        num_hidden_layers=int(value("block_count")),
        num_attention_heads=int(value("attention.head_count")),
        image_size=int(value("image_size")),
        patch_size=int(value("patch_size")),
        layer_norm_eps=float(value("attention.layer_norm_epsilon")),
        vision_use_head=False,
    )
    # llama.cpp pools the patch grid by its scale factor (4 where the file does not say).
    scale = int(field_value(reader, "clip.vision.projector.scale_factor") or 4)
    per_side = vision.image_size // vision.patch_size // scale
    tokens = list(field_value(_reader(text_path), "tokenizer.ggml.tokens") or [])
    missing = [token for token in _GEMMA3_TOKENS if token not in tokens]
    if missing:
        raise ValueError(f"{text_path}: the vocabulary lacks the image tokens {missing}")
    boi, eoi, image = (tokens.index(token) for token in _GEMMA3_TOKENS)
    return Gemma3Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        mm_tokens_per_image=per_side**2,
        boi_token_index=boi,
        eoi_token_index=eoi,
        image_token_index=image,
        architectures=["Gemma3ForConditionalGeneration"],
    )


def iter_mmproj_weights(mmproj: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The projector file's tensors, float32, named as our vision-language class loads them."""
    import gguf

    for tensor in _reader(mmproj).tensors:
        base, _, kind = tensor.name.rpartition(".")
        layer = re.fullmatch(r"v\.blk\.(\d+)\.(\w+)", base)
        if layer is not None and layer.group(2) in _LAYER_NAMES:
            name = f"vision_tower.encoder.layers.{layer.group(1)}.{_LAYER_NAMES[layer.group(2)]}.{kind}"
        elif base in _GEMMA3_NAMES:
            name = f"{_GEMMA3_NAMES[base]}.{kind}"
        else:
            raise ValueError(f"{mmproj}: tensor {tensor.name!r} has no place in the model")
        shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dims innermost first
        data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        weight = torch.from_numpy(np.array(data, dtype=np.float32)).reshape(shape)
        if base == "mm.soft_emb_norm":
            weight = weight - 1  # llama.cpp stores Gemma's norm as the scale itself
        if name == "multi_modal_projector.mm_input_projection.weight":
            name = "multi_modal_projector.mm_input_projection_weight"
        yield name, weight


def num_tensors(mmproj: str) -> int:
    return len(_reader(mmproj).tensors)
