"""Which adapter a request runs with: vLLM's LoRARequest (name, integer id, path)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from pagedllm.digest import file_digest


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter a request runs under. `lora_int_id` (>= 1) names the adapter inside the
    engine: two requests with the same id use the same loaded weights. `base_model_name`: the
    served model it attaches to (None: the one model served)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("a LoRA adapter needs a name")
        if not self.lora_path:
            raise ValueError(f"LoRA adapter {self.lora_name!r} needs a path")
        object.__setattr__(self, "lora_path", os.path.abspath(os.path.expanduser(self.lora_path)))

    @cached_property
    def cache_key(self) -> tuple[str, str, tuple[str, ...]]:
        """What keeps its prefix-cache blocks apart from the base model's and other adapters': its
        path and its files' content (read once), so that a KV store on disk never gives an adapter
        rewritten in place the K/V of the one before."""
        return ("lora", self.lora_path, adapter_digests(self.lora_path))


def adapter_digests(path: str) -> tuple[str, ...]:
    """The digests of an adapter's files (a PEFT folder's config and weights, or a GGUF file);
    none where the path cannot be read (the request is refused elsewhere, by name)."""
    root = Path(path)
    try:
        files = [root] if root.is_file() else sorted(p for p in root.iterdir() if p.is_file())
        return tuple(f"{p.name}:{file_digest(p)}" for p in files)
    except OSError:
        return ()
