"""The names a request's `model` may take: the served model's, and its LoRA adapters' (loaded at
start with --lora-modules, or at runtime through /v1/load_lora_adapter), and /v1/models' list."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass

from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.entrypoints.openai.protocol import APIError
from pagedllm.entrypoints.openai.serving import off_loop
from pagedllm.lora.request import LoRARequest


@dataclass(frozen=True)
class LoRAModulePath:
    """One --lora-modules entry: `name=path`, or JSON with name, path and base_model_name."""

    name: str
    path: str
    base_model_name: str | None = None

    @classmethod
    def parse(cls, text: str) -> LoRAModulePath:
        if text.lstrip().startswith("{"):
            try:
                entry = json.loads(text)
            except ValueError as exc:
                raise ValueError(f"--lora-modules {text!r} is not valid JSON: {exc}") from None
            unknown = set(entry) - {"name", "path", "base_model_name"} if isinstance(entry, dict) else set()
            if not isinstance(entry, dict) or unknown or not entry.get("name") or not entry.get("path"):
                raise ValueError(
                    f"--lora-modules {text!r}: a JSON entry takes name, path and base_model_name"
                    + (f" (not {sorted(unknown)})" if unknown else "")
                )
            return cls(str(entry["name"]), str(entry["path"]), entry.get("base_model_name"))
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {text!r}: expected name=path or a JSON object")
        return cls(name, path)


class ServingModels:
    def __init__(self, engine: AsyncLLM, base_name: str) -> None:
        self.engine, self.base_name = engine, base_name
        self.adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def add_at_start(self, modules: list[LoRAModulePath]) -> None:
        """--lora-modules: each adapter checked against the model now (a ValueError stops the start)."""
        for module in modules:
            if self.engine.model_config.lora is None:
                raise ValueError("--lora-modules needs --enable-lora")
            self._add(self._request(module.name, module.path, module.base_model_name))

    def lookup(self, name: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model); an unknown name is a 404."""
        if name is None or name == self.base_name:
            return None
        adapter = self.adapters.get(name)
        if adapter is None:
            # OpenAI's answer: 404, an invalid request, code model_not_found.
            raise APIError(f"The model `{name}` does not exist.", 404, param="model", code="model_not_found")
        return adapter

    async def load(self, name: str, path: str) -> None:
        """POST /v1/load_lora_adapter: checked against the model (off the event loop), then served."""
        if self.engine.model_config.lora is None:
            raise APIError("LoRA adapters are not enabled on this server (start it with --enable-lora)")
        if name in self.adapters:
            raise APIError(f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        try:
            await off_loop(self._add, self._request(name, path, None))
        except ValueError as exc:
            raise APIError(str(exc), param="lora_path") from exc

    def unload(self, name: str) -> None:
        """POST /v1/unload_lora_adapter: no new request may name it; those running keep it."""
        if self.adapters.pop(name, None) is None:
            raise APIError(f"The lora adapter '{name}' cannot be found.", 404, "not_found_error", "lora_name")

    def cards(self) -> list[dict]:
        base = {
            "id": self.base_name,
            "object": "model",
            "created": 0,
            "owned_by": "pagedllm",
            "root": self.engine.model_config.path,
            "parent": None,
            "max_model_len": self.engine.max_model_len,
        }
        adapters = [
            base | {"id": name, "root": lora.lora_path, "parent": self.base_name}
            for name, lora in self.adapters.items()
        ]
        return [base, *adapters]

    def _request(self, name: str, path: str, base_model_name: str | None) -> LoRARequest:
        if name == self.base_name or name in self.adapters:
            raise ValueError(f"LoRA adapter name {name!r} is already taken (by the model or another adapter)")
        if base_model_name is not None and base_model_name != self.base_name:
            raise ValueError(f"LoRA adapter {name!r}: base_model_name {base_model_name!r} is not served here")
        return LoRARequest(name, next(self._ids), path, base_model_name)

    def _add(self, lora: LoRARequest) -> None:
        self.engine.check_lora(lora)
        self.adapters[lora.lora_name] = lora
