"""Mixtral: every layer's MLP a mixture of experts (top-2 of 8), their weights renormalized; the
checkpoint names its block `block_sparse_moe` and each expert's projections w1 (gate), w3 (up), w2 (down)."""

from __future__ import annotations

from pagedllm.models.moe import SparseMoEForCausalLM


class MixtralForCausalLM(SparseMoEForCausalLM):
    always_renormalize = True
    stacked_params = SparseMoEForCausalLM.stacked_params + (("gate_up_proj", "w1", 0), ("gate_up_proj", "w3", 1))

    @staticmethod
    def is_sparse(config, index: int) -> bool:
        return True

    @staticmethod
    def num_experts(config) -> int:
        return config.num_local_experts

    @staticmethod
    def expert_size(config) -> int:
        return config.intermediate_size

    def _target(self, name: str) -> tuple[str, str | int | None]:
        name = name.replace(".block_sparse_moe.", ".mlp.").replace(".w2.", ".down_proj.")
        return super()._target(name)
