"""LoRA adapters: the request's choice of adapter (request.py), reading and checking an adapter's
files (adapter.py: PEFT folders; plain data, no torch), and the worker's side: a linear layer's
adapter slots and the batched kernel's reference (layers.py), the adapters loaded and in slots
(manager.py)."""

from pagedllm.lora.request import LoRARequest

__all__ = ["LoRARequest"]
