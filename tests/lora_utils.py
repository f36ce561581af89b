"""Random PEFT LoRA adapters on the tests' tiny models, and transformers + peft as their oracle."""

from __future__ import annotations

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(base_dir: str, path, **options) -> str:
    """A PEFT adapter of `base_dir`'s model (adapter_of's options), saved to `path`."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    return adapter_of(base, path, **options)


def adapter_of(
    base,
    path,
    rank: int = 8,
    seed: int = 0,
    targets: tuple[str, ...] = ALL_TARGETS,
    alpha: float = 16,
    use_rslora: bool = False,
    scale: float = 0.2,
    **config,
) -> str:
    """A PEFT adapter of a transformers model (which peft wraps in place) with random A and B of
    their own seed (PEFT starts B at zero, which would change nothing), saved to `path`."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), use_rslora=use_rslora, **config)
    model = get_peft_model(base, lora)
    g = torch.Generator().manual_seed(1000 + seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=g) * scale)
    model.save_pretrained(path)
    return str(path)


def load_peft(base_dir: str, adapter_dir: str):
    """transformers' model of `base_dir` with the adapter applied by peft (fp32, eval)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter_dir).eval()
