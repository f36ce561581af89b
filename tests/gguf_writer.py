"""Write a tiny Hugging Face checkpoint as GGUF, laid out the way llama.cpp's converter would.

Test utility only: it lets tests build GGUF fixtures from random HF models, so the engine's GGUF
loader can be checked against the HF reference without downloading real GGUF files.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

# HF architecture -> GGUF architecture. Mistral is written as "llama", exactly as llama.cpp does.
_ARCHS: dict[str, gguf.MODEL_ARCH] = {
    "LlamaForCausalLM": gguf.MODEL_ARCH.LLAMA,
    "MistralForCausalLM": gguf.MODEL_ARCH.LLAMA,
    "Qwen2ForCausalLM": gguf.MODEL_ARCH.QWEN2,
    "Qwen3ForCausalLM": gguf.MODEL_ARCH.QWEN3,
    "Gemma3ForCausalLM": gguf.MODEL_ARCH.GEMMA3,
    "Gemma2ForCausalLM": gguf.MODEL_ARCH.GEMMA2,
    "Phi3ForCausalLM": gguf.MODEL_ARCH.PHI3,
    "Qwen2MoeForCausalLM": gguf.MODEL_ARCH.QWEN2MOE,
    "Qwen3MoeForCausalLM": gguf.MODEL_ARCH.QWEN3MOE,
    "MixtralForCausalLM": gguf.MODEL_ARCH.LLAMA,  # as llama.cpp writes Mixtral: a llama with experts
    "GraniteForCausalLM": gguf.MODEL_ARCH.GRANITE,  # llama's layout (Q/K interleaved) and four multipliers
    "GraniteMoeForCausalLM": gguf.MODEL_ARCH.GRANITE_MOE,  # the same, its stacked experts split gate from up
    "SmolLM3ForCausalLM": gguf.MODEL_ARCH.SMOLLM3,  # llama's layout; its NoPE layers fixed by llama.cpp, no key
    "Olmo2ForCausalLM": gguf.MODEL_ARCH.OLMO2,  # transformers' Q/K rows (NeoX rotary)
    "GptOssForCausalLM": gguf.MODEL_ARCH.GPT_OSS,  # its stacked experts de-interleaved and transposed
    "DeepseekV2ForCausalLM": gguf.MODEL_ARCH.DEEPSEEK2,  # one latent K/V head; kv_b_proj split in k_b and v_b
}
# Granite's multipliers: its config's name -> the GGUFWriter method llama.cpp's converter writes it with
_GRANITE_SCALES = {
    "embedding_multiplier": "add_embedding_scale",
    "residual_multiplier": "add_residual_scale",
    "attention_multiplier": "add_attention_scale",
    "logits_scaling": "add_logit_scale",
}
# Kept F32 whatever the file's type, as llama.cpp keeps them: the routers.
_KEEP_F32 = (".ffn_gate_inp.", ".ffn_gate_inp_shexp.")
_QTYPES = (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K",
    "Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS", "MXFP4", "IQ3_S",
)  # fmt: skip
_Q = gguf.GGMLQuantizationType


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # HF stores rotary halves as [x0..x(d/2-1) | x(d/2)..]; llama.cpp's "llama" rope pairs adjacent
    # elements, so each head's rows are re-interleaved. transformers' GGUF loader undoes this.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _check_quantizable(qt: gguf.GGMLQuantizationType) -> None:
    # gguf-py implements numpy quantizers for only some types (K-quants are dequantize-only),
    # so probe once with a single block instead of failing halfway through the file.
    try:
        gguf.quants.quantize(np.zeros((1, gguf.GGML_QUANT_SIZES[qt][0]), np.float32), qt)
    except NotImplementedError as e:
        raise NotImplementedError(
            f"the gguf package cannot quantize {qt.name} (it only dequantizes it); "
            "use F32/F16/BF16/Q8_0/Q4_0/Q4_1 or quantize with llama.cpp's llama-quantize"
        ) from e


# Each float16 field of a block: its byte offset, and how llama.cpp's quantizers set it. "+": a step
# or super-scale (from max - min, or from |max|); "±": d = the block's weight of largest magnitude
# / -8 (or -128), either sign; a number: that many times the step before it, which centres the
# block's weights on zero (Q4_1, Q5_1: the block's minimum; Q4_K, Q5_K: the super-scale of the mins,
# 8.1x the step's over Gemma 3 270M's Q4_K blocks).
HALF_FIELDS = {
    "Q4_0": ((0, "±"),),
    "Q5_0": ((0, "±"),),
    "Q8_0": ((0, "+"),),
    "Q4_1": ((0, "+"), (2, -7.5)),
    "Q5_1": ((0, "+"), (2, -15.5)),
    "Q4_K": ((0, "+"), (2, 7.5)),
    "Q5_K": ((0, "+"), (2, 15.5)),
    "Q6_K": ((208, "±"),),
    "Q2_K": ((80, "+"), (82, 1.5)),
    "Q3_K": ((108, "±"),),
    "IQ4_NL": ((0, "±"),),
    "IQ4_XS": ((0, "±"),),
    "IQ3_S": ((0, "+"),),
    "MXFP4": (),
}
# MXFP4's scale is a byte, E8M0: 2^(e - 128) for its doubled values.
E8M0_FIELDS = {"MXFP4": 0}
# Over one tensor of Gemma 3 270M's Q4_K_M file the fields' magnitudes run from 0.6-0.8x (5th
# percentile) to 1.4-1.9x (95th) their median, about a log-normal of sigma 0.3.
SCALE_SPREAD = 0.3


def random_blocks(qtype: str, rows: int, cols: int, median: float, seed: int = 0) -> np.ndarray:
    """Valid GGUF blocks of random bits whose float16 fields are as a quantizer leaves them: a
    spread of magnitudes around `median` and the signs above (gguf-py cannot quantize K types, so
    such a file is only good for comparing two readers of the same bytes)."""
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[_Q[qtype]]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, cols // block_values, block_bytes), dtype=np.uint8)
    step = np.zeros(blocks.shape[:2])
    for offset, kind in HALF_FIELDS[qtype]:
        spread = rng.lognormal(0.0, SCALE_SPREAD, blocks.shape[:2])
        if kind == "±":
            values = median * spread * rng.choice([-1.0, 1.0], blocks.shape[:2])
        else:
            values = median * spread if kind == "+" else kind * np.abs(step) * spread
        step = values
        blocks[..., offset : offset + 2] = values.astype(np.float16)[..., None].view(np.uint8)
    if qtype in E8M0_FIELDS:
        exponent = np.round(np.log2(median * rng.lognormal(0.0, SCALE_SPREAD, blocks.shape[:2]))) + 128
        blocks[..., E8M0_FIELDS[qtype]] = exponent.astype(np.uint8)
    return blocks.reshape(rows, -1)


# The types gguf-py cannot quantize, written as random blocks: their scales' medians, for weights of
# about the 0.05 spread the tests' models are made with.
_K_MEDIANS = {
    _Q.Q4_K: 2e-4, _Q.Q5_K: 1e-4, _Q.Q6_K: 5e-5, _Q.Q2_K: 2e-3, _Q.Q3_K: 1.5e-3,
    _Q.IQ4_NL: 8e-4, _Q.IQ4_XS: 5e-5, _Q.IQ3_S: 4e-4, _Q.MXFP4: 1e-2,
}  # fmt: skip


def _random_k_blocks(w: np.ndarray, qt: gguf.GGMLQuantizationType) -> np.ndarray:
    rows = int(np.prod(w.shape[:-1]))  # experts stacked: [experts, rows, columns]
    return random_blocks(qt.name, rows, w.shape[-1], _K_MEDIANS[qt], seed=w.size).reshape(*w.shape[:-1], -1)


def _encode(w: np.ndarray, qt: gguf.GGMLQuantizationType) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
    # 1-D tensors (norms, biases) stay F32, as in llama.cpp.
    if w.ndim < 2 or qt == _Q.F32:
        return w, _Q.F32
    if qt in _K_MEDIANS:
        if w.shape[-1] % gguf.GGML_QUANT_SIZES[qt][0]:
            return gguf.quants.quantize(w, _Q.F16), _Q.F16
        return _random_k_blocks(w, qt), qt
    try:
        return gguf.quants.quantize(w, qt), qt
    except gguf.QuantError:  # rows not a multiple of the block size: llama.cpp falls back to F16
        return gguf.quants.quantize(w, _Q.F16), _Q.F16


def _stack_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each layer's routed experts as one [experts, rows, columns] tensor a projection, named as
    llama.cpp's converter names it before mapping ("...mlp.experts.gate_proj.weight"); Mixtral's
    block_sparse_moe/w1/w3/w2 names read as Qwen's mlp/gate_proj/up_proj/down_proj."""
    renames = {".block_sparse_moe.": ".mlp.", ".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."}
    stacks: dict[str, dict[int, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        for old, new in renames.items():
            name = name.replace(old, new)
        parts = name.split(".")
        if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
            i = parts.index("experts")
            stacks.setdefault(".".join(parts[: i + 1] + parts[i + 2 :]), {})[int(parts[i + 1])] = t
        else:
            out[name] = t
    for name, by_expert in stacks.items():
        out[name] = torch.stack([by_expert[e] for e in sorted(by_expert)])
    return _gpt_oss_experts(_granite_moe_experts(out))


def _gpt_oss_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """gpt-oss's experts as llama.cpp's converter writes them: gate_up_proj [experts, hidden, 2 x
    intermediate] transposed and split by columns (gate the even ones, up the odd), down_proj
    transposed; their biases likewise."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        prefix, found, part = name.partition(".mlp.experts.")
        if found and part in ("gate_up_proj", "gate_up_proj_bias"):
            kind = "weight" if part == "gate_up_proj" else "bias"
            rows = t.transpose(-1, -2) if kind == "weight" else t
            out[f"{prefix}.mlp.experts.gate_proj.{kind}"] = rows[:, 0::2].contiguous()
            out[f"{prefix}.mlp.experts.up_proj.{kind}"] = rows[:, 1::2].contiguous()
        elif found and part in ("down_proj", "down_proj_bias"):
            kind = "weight" if part == "down_proj" else "bias"
            out[f"{prefix}.mlp.experts.down_proj.{kind}"] = t.transpose(-1, -2).contiguous() if kind == "weight" else t
        else:
            out[name] = t
    return out


def _granite_moe_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Granite-MoE's stacked experts (already [experts, rows, columns]: its input_linear gate and up
    together) under the names above, gate split from up as llama.cpp's converter splits them."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        prefix, found, part = name.partition(".mlp.")
        if found and part == "input_linear.weight":
            gate, up = t.chunk(2, dim=1)
            out[f"{prefix}.mlp.experts.gate_proj.weight"], out[f"{prefix}.mlp.experts.up_proj.weight"] = gate, up
        elif found and part == "output_linear.weight":
            out[f"{prefix}.mlp.experts.down_proj.weight"] = t
        elif found and part == "router.layer.weight":
            out[f"{prefix}.mlp.gate.weight"] = t
        else:
            out[name] = t
    return out


def _write_deepseek2_keys(w: gguf.GGUFWriter, cfg: dict, rope: dict) -> None:
    """DeepSeek-V2's keys as llama.cpp's converter writes them: the latent's sizes as the one K/V
    head's (key: latent + rotary key, value: latent), the MLA head sizes, the experts' options,
    YaRN's log multiplier (0.1 x mscale_all_dim)."""
    rank, rope_dim = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    if cfg.get("q_lora_rank"):
        w.add_q_lora_rank(cfg["q_lora_rank"])
    w.add_kv_lora_rank(rank)
    w.add_key_length(rank + rope_dim)
    w.add_value_length(rank)
    w.add_key_length_mla(cfg["qk_nope_head_dim"] + rope_dim)
    w.add_value_length_mla(cfg["v_head_dim"])
    w.add_expert_shared_count(cfg["n_shared_experts"])
    w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    w.add_expert_weights_norm(bool(cfg["norm_topk_prob"]))
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SOFTMAX)
    if cfg.get("topk_method") == "group_limited_greedy":
        w.add_expert_group_count(cfg["n_group"])
        w.add_expert_group_used_count(cfg["topk_group"])
    w.add_rope_dimension_count(rope_dim)
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def _split_kv_b(tensors: dict[str, torch.Tensor], cfg: dict) -> dict[str, torch.Tensor]:
    """kv_b_proj [heads x (nope + v), latent] as llama.cpp's converter splits it: k_b_proj [heads,
    latent, nope] (each head's key half transposed) and v_b_proj [heads, v, latent]."""
    out: dict[str, torch.Tensor] = {}
    nope, v = cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    for name, t in tensors.items():
        if name.endswith("kv_b_proj.weight"):
            k_b, v_b = t.view(cfg["num_attention_heads"], nope + v, -1).split([nope, v], dim=1)
            out[name.replace("kv_b_proj", "k_b_proj")] = k_b.transpose(1, 2).contiguous()
            out[name.replace("kv_b_proj", "v_b_proj")] = v_b.contiguous()
        else:
            out[name] = t
    return out


def _pre_tokenizer_name(tok_json: dict) -> str:
    # llama.cpp picks tokenizer.ggml.pre by hashing tokenizer output; we instead match the split
    # regex against the names transformers' GGUF tokenizer loader knows, so a round trip is exact.
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS as splits

    pre = tok_json.get("pre_tokenizer") or {}
    found = {p["pattern"].get("Regex") for p in pre.get("pretokenizers", [pre]) if p.get("type") == "Split"}
    for name in ("llama-bpe", "qwen2", "qwen35", "tekken", "gpt-4o"):
        if splits.get(name) in found:
            return name
    return "default"


def _write_tokenizer(w: gguf.GGUFWriter, tok_dir: Path, vocab_size: int) -> None:
    tok_json = json.loads((tok_dir / "tokenizer.json").read_text(encoding="utf-8"))
    model = tok_json["model"]
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        raise NotImplementedError("only byte-level BPE ('gpt2') tokenizers are supported")
    id_to_tok = {i: t for t, i in model["vocab"].items()}
    types = {i: gguf.TokenType.NORMAL for i in id_to_tok}
    for added in tok_json.get("added_tokens", []):
        id_to_tok[added["id"]] = added["content"]
        types[added["id"]] = gguf.TokenType.CONTROL if added["special"] else gguf.TokenType.USER_DEFINED
    # The embedding may be padded past the tokenizer; llama.cpp fills the gap with unused [PADn].
    n = max(vocab_size, max(id_to_tok) + 1)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(_pre_tokenizer_name(tok_json))
    w.add_token_list([id_to_tok.get(i, f"[PAD{i}]") for i in range(n)])
    w.add_token_types([types.get(i, gguf.TokenType.UNUSED) for i in range(n)])
    # SpecialVocab reads merges, bos/eos/unk/pad ids, add_bos flags and the chat template
    # (tokenizer_config.json or chat_template.jinja) the same way llama.cpp's converter does.
    gguf.SpecialVocab(tok_dir, load_merges=True, n_vocab=n).add_to_gguf(w, quiet=True)


def write_gguf(
    hf_dir: str,
    out_path: str,
    qtype: str = "F32",
    tokenizer_dir: str | None = None,
    overrides: dict[str, str] | None = None,
    drop_keys: tuple[str, ...] = (),
) -> None:
    """Convert `hf_dir` (config.json + *.safetensors) to a GGUF file at `out_path`, its matrices in
    `qtype` but those whose GGUF name contains a key of `overrides` (as a Q4_K_M file mixes Q4_K
    with Q6_K for attn_v and ffn_down: {"attn_v": "Q6_K", "ffn_down": "Q6_K"}); metadata keys in
    `drop_keys` left out (a damaged or incomplete file, for tests of the loader's errors)."""
    overrides = overrides or {}
    for name in {qtype, *overrides.values()}:
        if name not in _QTYPES:
            raise ValueError(f"qtype must be one of {_QTYPES}, got {name!r}")
        if _Q[name] not in (_Q.F32, _Q.F16) and _Q[name] not in _K_MEDIANS:
            _check_quantizable(_Q[name])
    qt = _Q[qtype]
    src = Path(hf_dir)
    cfg = json.loads((src / "config.json").read_text())
    hf_arch = cfg["architectures"][0]
    if hf_arch not in _ARCHS:
        raise NotImplementedError(f"unsupported architecture {hf_arch}")
    arch = _ARCHS[hf_arch]
    rope = cfg.get("rope_parameters") or {}
    if arch == gguf.MODEL_ARCH.QWEN2 and "mrope_section" in rope:
        arch = gguf.MODEL_ARCH.QWEN2VL  # Qwen2-VL's language model, as llama.cpp writes it
    n_layer, n_head = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    n_kv = cfg.get("num_key_value_heads") or n_head
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_head
    # transformers 5 moved rope_theta into rope_parameters; older configs keep it top-level.
    rope = rope.get("full_attention", rope)  # Gemma 3: per kind of layer; the file holds the global base
    rope_theta = cfg.get("rope_theta") or rope.get("rope_theta", 10000.0)

    w = gguf.GGUFWriter(out_path, gguf.MODEL_ARCH_NAMES[arch])
    # Never exactly "mistral": transformers would then map the file to its Mistral class, whose
    # GGUF tensor mapping needs a "mistral" arch that gguf-py lacks. As "llama" it loads fine.
    w.add_name(src.name)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(n_layer)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_head)
    deepseek = arch == gguf.MODEL_ARCH.DEEPSEEK2
    w.add_head_count_kv(1 if deepseek else n_kv)
    w.add_rope_freq_base(float(rope_theta))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    granite = arch in (gguf.MODEL_ARCH.GRANITE, gguf.MODEL_ARCH.GRANITE_MOE)
    llama_layout = granite or arch in (gguf.MODEL_ARCH.LLAMA, gguf.MODEL_ARCH.SMOLLM3)
    if llama_layout:
        w.add_rope_dimension_count(head_dim)  # llama.cpp's llama reads head size from here
    if granite:
        for key, method in _GRANITE_SCALES.items():
            getattr(w, method)(float(cfg[key]))
    if arch == gguf.MODEL_ARCH.PHI3:  # the rotated dims; LongRoPE's factors as tensors, as llama.cpp writes them
        w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
        if rope.get("rope_type") == "longrope":
            w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
            w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))
            w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], np.float32))
    if arch == gguf.MODEL_ARCH.QWEN2VL:  # M-RoPE's sections, four as llama.cpp keeps them
        w.add_rope_dimension_sections([*rope["mrope_section"], 0, 0, 0][:4])
    if deepseek:
        _write_deepseek2_keys(w, cfg, rope)
    elif cfg.get("head_dim"):  # explicit head_dim (e.g. Qwen3) may differ from hidden/heads
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if cfg.get("sliding_window"):
        w.add_sliding_window(cfg["sliding_window"])
    if arch == gguf.MODEL_ARCH.GEMMA2:
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if arch == gguf.MODEL_ARCH.GPT_OSS:  # its expert size, and YaRN's factor and original context
        w.add_expert_feed_forward_length(cfg["intermediate_size"])
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts")
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        if cfg.get("moe_intermediate_size"):
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if cfg.get("shared_expert_intermediate_size"):
            w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    file_types = {
        "Q4_K": "MOSTLY_Q4_K_M", "Q5_K": "MOSTLY_Q5_K_M", "Q6_K": "MOSTLY_Q6_K", "Q3_K": "MOSTLY_Q3_K_M",
        "MXFP4": "MOSTLY_MXFP4_MOE",
    }  # fmt: skip
    w.add_file_type(
        gguf.LlamaFileType.ALL_F32 if qt == _Q.F32 else gguf.LlamaFileType[file_types.get(qtype, f"MOSTLY_{qtype}")]
    )
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if tokenizer_dir is not None:
        _write_tokenizer(w, Path(tokenizer_dir), cfg["vocab_size"])

    names = gguf.get_tensor_name_map(arch, n_layer)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    tensors = _split_kv_b(_stack_experts(tensors), cfg) if deepseek else _stack_experts(tensors)
    for hf_name, t in tensors.items():
        if hf_name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue  # tied: llama.cpp omits output.weight and reuses token_embd
        if hf_name.endswith("rotary_emb.inv_freq"):
            continue  # buffer in some older checkpoints, recomputed from rope_theta
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"cannot map tensor {hf_name}")
        if hf_name.endswith("self_attn.sinks"):
            name += ".weight"  # as llama.cpp names its sinks
        data = t.to(torch.float32).numpy()
        if name.endswith("ffn_gate_inp_shexp.weight"):
            data = data.reshape(-1)  # llama.cpp's shared-expert gate is one row, stored 1-D ({n_embd})
        if arch in (gguf.MODEL_ARCH.GEMMA2, gguf.MODEL_ARCH.GEMMA3) and hf_name.endswith("norm.weight"):
            data = data + 1  # llama.cpp's converter stores Gemma's norms as the scale itself
        if llama_layout and name.startswith("blk.") and ".attn_q." in name:
            data = _permute(data, n_head)
        elif llama_layout and name.startswith("blk.") and ".attn_k." in name:
            data = _permute(data, n_kv)
        tensor_qt = next((_Q[t] for part, t in overrides.items() if part in name), qt)
        if any(part in name for part in _KEEP_F32) or name.endswith(".bias"):
            tensor_qt = _Q.F32
        data, dtype = _encode(data, tensor_qt)
        w.add_tensor(name, data, raw_dtype=dtype)

    for key in drop_keys:
        del w.kv_data[0][key]
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
