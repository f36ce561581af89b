"""The worker's LoRA adapters: slots in the model's linear layers (layers/lora.py), the adapters
loaded in memory (at most `max_cpu_loras`, least recently used dropped first, never one that a
request the worker holds runs under), and before each step, which slot each row runs with."""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
from safetensors.torch import load_file

from pagedllm.config import LoRAConfig, text_config
from pagedllm.layers.linear import Linear
from pagedllm.layers.lora import LoRAContext, LoRASlots, ShardUpdate
from pagedllm.lora.adapter import read_adapter
from pagedllm.lora.request import LoRARequest
from pagedllm.models.gguf import unpermute_qk

logger = logging.getLogger(__name__)

# The layers that take adapters: attention's and a dense gated MLP's (not experts').
_SLOTTED = re.compile(r"model\.layers\.\d+\.(self_attn\.(qkv_proj|o_proj)|mlp\.(gate_up_proj|down_proj))")
# An adapter's module (Hugging Face's name) -> our layer and the shard of it (None: all of it).
_MODULE_TO_LAYER: dict[str, tuple[str, str | int | None]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "qkv_proj": ("qkv_proj", None),
    "o_proj": ("o_proj", None),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "gate_up_proj": ("gate_up_proj", None),
    "down_proj": ("down_proj", None),
}


@dataclass
class LoadedAdapter:
    """An adapter's updates by our layer's name, in the model's dtype."""

    request: LoRARequest
    updates: dict[str, list[ShardUpdate]]
    nbytes: int


class LoRAManager:
    def __init__(self, model: torch.nn.Module, config: LoRAConfig, dtype: torch.dtype, device: torch.device) -> None:
        self.config, self.dtype = config, dtype
        self.ctx = LoRAContext()
        self.layers: dict[str, LoRASlots] = {}
        for name, module in model.named_modules():
            if isinstance(module, Linear) and _SLOTTED.fullmatch(name):
                module.lora = LoRASlots(module, self.ctx, config.max_loras, config.max_lora_rank, dtype, device)
                self.layers[name] = module.lora
        if not self.layers:
            raise ValueError(f"{type(model).__name__} has no layers that take LoRA adapters")
        fmt = getattr(type(model), "gguf", None)
        self.permuted_qk = fmt is not None and fmt.permuted_qk  # GGUF adapters of such families
        text = text_config(getattr(model, "config", None))
        self.heads = {
            "q_proj": getattr(text, "num_attention_heads", 0),
            "k_proj": getattr(text, "num_key_value_heads", 0),
        }
        self.loaded: OrderedDict[int, LoadedAdapter] = OrderedDict()  # by id, least recently used first
        self.slots: list[LoadedAdapter | None] = [None] * config.max_loras  # the adapter in each slot
        logger.info(
            "LoRA: %d layers with %d slots of rank up to %d (%.1f MiB)",
            len(self.layers),
            config.max_loras,
            config.max_lora_rank,
            sum(s.nbytes for s in self.layers.values()) / 2**20,
        )

    @property
    def loaded_bytes(self) -> int:
        return sum(a.nbytes for a in self.loaded.values())

    def prepare_step(self, requests: list[LoRARequest | None], rows: list[int], live: set[int]) -> None:
        """Slot each of the step's requests' adapters (loading them where needed) and set the rows'
        slots: `rows` per request; `live`: the ids of adapters the worker's requests run under."""
        ids = [r.lora_int_id if r is not None else 0 for r in requests]
        if not any(ids):
            self.ctx.set_rows(None)
            return
        wanted = {i: r for i, r in zip(ids, requests) if r is not None}
        if len(wanted) > len(self.slots):
            raise RuntimeError(f"a step with {len(wanted)} adapters; the worker has {len(self.slots)} slots")
        adapters = {adapter_id: self._load(request, live) for adapter_id, request in wanted.items()}
        slot_of = {}
        for adapter_id, adapter in adapters.items():
            slot = next((s for s, held in enumerate(self.slots) if held is adapter), None)
            slot_of[adapter_id] = self._slot(adapter, list(adapters.values())) if slot is None else slot
        per_request = np.array([slot_of.get(i, -1) for i in ids], dtype=np.int32)
        self.ctx.set_rows(torch.from_numpy(np.repeat(per_request, rows)))

    def _slot(self, adapter: LoadedAdapter, step: list[LoadedAdapter]) -> int:
        """Into a free slot, else one whose adapter this step does not run; returns the slot."""
        slot = next((s for s, held in enumerate(self.slots) if held is None), None)
        if slot is None:
            slot = next(s for s, held in enumerate(self.slots) if not any(held is a for a in step))
        for name, layer in self.layers.items():
            updates = adapter.updates.get(name)
            if updates:
                layer.load(slot, updates)
            else:
                layer.clear(slot)
        self.slots[slot] = adapter
        return slot

    def _load(self, request: LoRARequest, live: set[int]) -> LoadedAdapter:
        adapter = self.loaded.get(request.lora_int_id)
        if adapter is not None and adapter.request.lora_path == request.lora_path:
            self.loaded.move_to_end(request.lora_int_id)
            return adapter
        adapter = self._read(request)
        self.loaded[request.lora_int_id] = adapter
        self._evict(live | {request.lora_int_id})
        logger.info(
            "LoRA adapter %r loaded: %.1f MiB; %d loaded, %.1f MiB",
            request.lora_name,
            adapter.nbytes / 2**20,
            len(self.loaded),
            self.loaded_bytes / 2**20,
        )
        return adapter

    def _evict(self, keep: set[int]) -> None:
        """Past max_cpu_loras, drop the least recently used adapters that no held request runs
        under and no slot holds (their slots are cleared first)."""
        for adapter_id in list(self.loaded):
            if len(self.loaded) <= self.config.cpu_loras:
                return
            if adapter_id in keep:
                continue
            adapter = self.loaded.pop(adapter_id)
            self.slots = [None if held is adapter else held for held in self.slots]

    def _read(self, request: LoRARequest) -> LoadedAdapter:
        """An adapter's tensors, scaled, by our layer's name."""
        info = read_adapter(request.lora_path)
        tensors = load_file(info.weights_file) if info.gguf_arch is None else _gguf_tensors(info.weights_file)
        updates: dict[str, list[ShardUpdate]] = {}
        nbytes = 0
        for module in info.modules:
            parent, _, leaf = module.name.rpartition(".")
            ours, shard = _MODULE_TO_LAYER.get(leaf, (leaf, None))
            name = f"{parent}.{ours}"
            if name not in self.layers:
                raise ValueError(f"LoRA adapter {request.lora_name!r}: {module.name} takes no adapter in this model")
            a_name, b_name = module.tensors
            a = tensors[a_name].to(self.dtype)
            b = tensors[b_name].float()
            if info.gguf_arch is not None and leaf in ("q_proj", "k_proj") and self.permuted_qk:
                # llama.cpp's converter interleaved B's rows as it does the base's q/k rows.
                b = unpermute_qk(b, self.heads[leaf])
            b = (b * module.scaling).to(self.dtype)
            updates.setdefault(name, []).append((shard, a, b))
            nbytes += a.nbytes + b.nbytes
        return LoadedAdapter(request, updates, nbytes)


def _gguf_tensors(path: str) -> dict[str, torch.Tensor]:
    """A GGUF adapter's tensors by name, in fp32 (quantized ones by the gguf package's dequantization)."""
    import gguf

    tensors = {}
    for tensor in gguf.GGUFReader(path).tensors:
        shape = [int(d) for d in reversed(tensor.shape)]
        data = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        tensors[tensor.name] = torch.from_numpy(data.reshape(shape).copy())
    return tensors
