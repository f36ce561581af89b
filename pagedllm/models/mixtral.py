"""Mixtral: every layer's MLP a mixture of experts (top-2 of 8), their weights renormalized; the
checkpoint names its block `block_sparse_moe` and each expert's projections w1 (gate), w3 (up), w2 (down)."""

from __future__ import annotations

from pagedllm.models.moe import AllSparseMoEForCausalLM


class MixtralForCausalLM(AllSparseMoEForCausalLM):
    always_renormalize = True
    stacked_params = AllSparseMoEForCausalLM.stacked_params + (("gate_up_proj", "w1", 0), ("gate_up_proj", "w3", 1))

    def _target(self, name: str) -> tuple[str, str | int | None]:
        name = name.replace(".block_sparse_moe.", ".mlp.").replace(".w2.", ".down_proj.")
        return super()._target(name)
