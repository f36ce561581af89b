"""llama.cpp's vision projector files (`mmproj`, GGUF of general.architecture "clip"), beside a
text model's GGUF file: the config of the vision-language model they make together, and the
projector file's tensors under the names our vision-language classes load. Projector types:
Gemma 3's ("gemma3") and Qwen2-VL's ("qwen2vl_merger")."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.models.gguf import _reader, field_value


@dataclass(frozen=True)
class Projector:
    text_model_type: str  # the text file's config's model_type it goes with
    # llama.cpp's names (without .weight/.bias) -> ours; a block's after "v.blk.N.", under `blocks`.
    names: dict[str, str]
    blocks: str
    block_names: dict[str, str]
    tokens: tuple[str, ...]  # the image tokens the text file's vocabulary must hold, in config order
    config: Callable  # (text config, vision settings, token ids, reader) -> the transformers config


def _gemma3_config(text, vision: dict, tokens: list[int], reader):
    from transformers import Gemma3Config, SiglipVisionConfig

    config = SiglipVisionConfig(
        hidden_size=vision["embedding_length"],
        intermediate_size=vision["feed_forward_length"],
        num_hidden_layers=vision["block_count"],
        num_attention_heads=vision["attention.head_count"],
        image_size=vision["image_size"],
        patch_size=vision["patch_size"],
        layer_norm_eps=vision["attention.layer_norm_epsilon"],
        vision_use_head=False,
    )
    # llama.cpp pools the patch grid by its scale factor (4 where the file does not say).
    scale = int(field_value(reader, "clip.vision.projector.scale_factor") or 4)
    boi, eoi, image = tokens
    return Gemma3Config(
        text_config=text.to_dict(),
        vision_config=config.to_dict(),
        mm_tokens_per_image=(config.image_size // config.patch_size // scale) ** 2,
        boi_token_index=boi,
        eoi_token_index=eoi,
        image_token_index=image,
        architectures=["Gemma3ForConditionalGeneration"],
    )


def _qwen2vl_config(text, vision: dict, tokens: list[int], reader):
    from transformers import Qwen2VLConfig

    start, end, image, video = tokens
    return Qwen2VLConfig(
        text_config=text.to_dict(),
        vision_config={
            "depth": vision["block_count"],
            "embed_dim": vision["embedding_length"],
            "hidden_size": vision["projection_dim"],
            "num_heads": vision["attention.head_count"],
            "mlp_ratio": vision["feed_forward_length"] // vision["embedding_length"],
            "patch_size": vision["patch_size"],
            "spatial_merge_size": 2,  # Qwen2-VL's: the file does not say
            "temporal_patch_size": 2,  # the converter splits the kernel in two (llama.cpp takes only 2)
        },
        image_token_id=image,
        video_token_id=video,
        vision_start_token_id=start,
        vision_end_token_id=end,
        architectures=["Qwen2VLForConditionalGeneration"],
    )


_SIGLIP_BLOCK = {
    "ln1": "layer_norm1",
    "ln2": "layer_norm2",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_out": "self_attn.out_proj",
    "ffn_up": "mlp.fc1",
    "ffn_down": "mlp.fc2",
}
PROJECTORS = {
    "gemma3": Projector(
        "gemma3_text",
        {
            "v.patch_embd": "vision_tower.embeddings.patch_embedding",
            "v.position_embd": "vision_tower.embeddings.position_embedding",
            "v.post_ln": "vision_tower.post_layernorm",
            "mm.input_projection": "multi_modal_projector.mm_input_projection",
            "mm.soft_emb_norm": "multi_modal_projector.mm_soft_emb_norm",
        },
        "vision_tower.encoder.layers",
        _SIGLIP_BLOCK,
        ("<start_of_image>", "<end_of_image>", "<image_soft_token>"),
        _gemma3_config,
    ),
    "qwen2vl_merger": Projector(
        "qwen2",
        {
            "v.patch_embd": "visual.patch_embed.proj",
            "v.post_ln": "visual.merger.ln_q",
            "mm.0": "visual.merger.mlp.0",
            "mm.2": "visual.merger.mlp.2",
        },
        "visual.blocks",
        {
            "ln1": "norm1",
            "ln2": "norm2",
            "attn_q": "attn.q",
            "attn_k": "attn.k",
            "attn_v": "attn.v",
            "attn_out": "attn.proj",
            "ffn_up": "mlp.fc1",
            "ffn_down": "mlp.fc2",
        },
        ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"),
        _qwen2vl_config,
    ),
}


def projector_type(mmproj: str) -> str:
    reader = _reader(mmproj)
    if field_value(reader, "general.architecture") != "clip" or not field_value(reader, "clip.has_vision_encoder"):
        raise ValueError(f"{mmproj}: not a vision projector (mmproj) GGUF file")
    kind = str(field_value(reader, "clip.projector_type"))
    if kind not in PROJECTORS:
        raise ValueError(f"{mmproj}: projector type {kind!r} is not supported (supported: {', '.join(PROJECTORS)})")
    return kind


def mmproj_config(text, text_path: str, mmproj: str):
    """The vision-language model's transformers config: the text file's config (`text`) and the
    projector file's vision settings; its image tokens' ids from the text file's vocabulary."""
    projector = PROJECTORS[projector_type(mmproj)]
    if text.model_type != projector.text_model_type:
        raise ValueError(
            f"{mmproj}: this projector goes with a {projector.text_model_type} text model, not {text.model_type}"
        )
    reader = _reader(mmproj)
    keys = ("embedding_length", "feed_forward_length", "block_count", "attention.head_count", "image_size")
    vision: dict = {}
    for key in (*keys, "patch_size", "projection_dim", "attention.layer_norm_epsilon"):
        vision[key] = field_value(reader, f"clip.vision.{key}")
        if vision[key] is None:
            raise ValueError(f"{mmproj}: the projector file lacks clip.vision.{key}")
    vision = {k: float(v) if k == "attention.layer_norm_epsilon" else int(v) for k, v in vision.items()}
    if vision["projection_dim"] != text.hidden_size:
        raise ValueError(f"{mmproj}: projects to {vision['projection_dim']} wide, the text model is {text.hidden_size}")
    vocabulary = list(field_value(_reader(text_path), "tokenizer.ggml.tokens") or [])
    missing = [token for token in projector.tokens if token not in vocabulary]
    if missing:
        raise ValueError(f"{text_path}: the vocabulary lacks the image tokens {missing}")
    return projector.config(text, vision, [vocabulary.index(t) for t in projector.tokens], reader)


def iter_mmproj_weights(mmproj: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The projector file's tensors, float32, named as our vision-language class loads them; the
    pieces llama.cpp's converter split (Qwen2-VL's q/k/v, its Conv3d's two time steps) joined."""
    import gguf

    projector = PROJECTORS[projector_type(mmproj)]
    pieces: dict[str, dict[str, torch.Tensor]] = {}
    for tensor in _reader(mmproj).tensors:
        match = re.fullmatch(r"(.+)\.(weight|bias)(\.1)?", tensor.name)
        if match is None:
            raise ValueError(f"{mmproj}: tensor {tensor.name!r} has no place in the model")
        base, kind, second = match.groups()
        block = re.fullmatch(r"v\.blk\.(\d+)\.(\w+)", base)
        if block is not None and block.group(2) in projector.block_names:
            name = f"{projector.blocks}.{block.group(1)}.{projector.block_names[block.group(2)]}.{kind}"
        elif base in projector.names:
            name = f"{projector.names[base]}.{kind}"
        else:
            raise ValueError(f"{mmproj}: tensor {tensor.name!r} has no place in the model")
        shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dims innermost first
        data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        weight = torch.from_numpy(np.array(data, dtype=np.float32)).reshape(shape)
        if base == "mm.soft_emb_norm":
            weight = weight - 1  # llama.cpp stores Gemma's norm as the scale itself
        if name == "multi_modal_projector.mm_input_projection.weight":
            name = "multi_modal_projector.mm_input_projection_weight"
        if re.search(r"attn\.[qkv]\.", name) or name == "visual.patch_embed.proj.weight":
            pieces.setdefault(re.sub(r"attn\.[qkv]\.", "attn.qkv.", name), {})[
                "1" if second else name.split(".")[-2]
            ] = weight
            continue
        yield name, weight
    for name, parts in pieces.items():
        if name == "visual.patch_embed.proj.weight":  # [out, C, P, P] a time step -> [out, C, 2, P, P]
            yield name, torch.stack([parts["proj"], parts["1"]], dim=2)
        else:
            yield name, torch.cat([parts["q"], parts["k"], parts["v"]])


def num_tensors(mmproj: str) -> int:
    return len(_reader(mmproj).tensors)
