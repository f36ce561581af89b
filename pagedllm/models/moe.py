"""What the mixture-of-experts families share: the Llama-like decoder whose MLP, on the layers the
config says, is a SparseMoE (layers/moe.py); the families (qwen2_moe.py, qwen3_moe.py, mixtral.py)
set its options and their checkpoint's names."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import ClassVar

from torch import nn

from pagedllm.layers.moe import Expert, SparseMoE
from pagedllm.layers.quantization import QuantizationConfig
from pagedllm.models.decoder import DecoderConfig, DecoderForCausalLM, DecoderModel, GatedMLP

logger = logging.getLogger(__name__)


class SparseMoEForCausalLM(DecoderForCausalLM):
    supports_tensor_parallel = False  # its own layers, not split over ranks yet
    # A shared expert beside the routed ones (Qwen2-MoE).
    shared_expert: ClassVar[bool] = False
    # Top-k probabilities rescaled to sum to 1 whatever the config says (Mixtral).
    always_renormalize: ClassVar[bool] = False
    # The router's logits have a bias (gpt-oss).
    router_bias: ClassVar[bool] = False

    def build_model(
        self, config, cfg: DecoderConfig, max_positions: int, quant: QuantizationConfig | None
    ) -> nn.Module:
        def make_mlp(index: int, prefix: str) -> nn.Module:
            if not self.is_sparse(config, index):
                return GatedMLP(cfg, quant, prefix)
            shared = getattr(config, "shared_expert_intermediate_size", 0) if self.shared_expert else 0
            options = {"shared_intermediate": shared, "router_bias": self.router_bias, **self.moe_options(config)}
            return SparseMoE(
                cfg.hidden_size,
                self.expert_size(config),
                self.num_experts(config),
                config.num_experts_per_tok,
                self.always_renormalize or bool(getattr(config, "norm_topk_prob", False)),
                quant,
                prefix,
                expert=self.make_expert(config),
                **options,
            )

        return DecoderModel(config, cfg, max_positions, quant, make_mlp, self.decoder_layer)

    def bind_kernels(self) -> None:
        """Each MoE block's routed experts as one C++ call (layers/moe.py's SparseMoE.bind_kernel)
        where they have ops, then the decoder stack, which runs that call as the layer's MLP."""
        reasons = {block.bind_kernel() for block in self.model.layers.modules() if isinstance(block, SparseMoE)}
        for reason in reasons - {None}:
            logger.info("%s runs its experts op by op: %s", type(self).__name__, reason)
        super().bind_kernels()

    @staticmethod
    def make_expert(config) -> Callable[[int, int, QuantizationConfig | None, str], nn.Module]:
        """What the family's experts are made by (layers/moe.py's SparseMoE `expert`)."""
        return Expert

    @staticmethod
    def moe_options(config) -> dict:
        """The family's SparseMoE options beyond the shared expert and the router's bias (DeepSeek's)."""
        return {}

    @staticmethod
    def is_sparse(config, index: int) -> bool:
        """Qwen's configs keep some layers dense: mlp_only_layers, and all but every decoder_sparse_step-th."""
        step = getattr(config, "decoder_sparse_step", 1) or 1
        return index not in (getattr(config, "mlp_only_layers", None) or []) and (index + 1) % step == 0

    @staticmethod
    def num_experts(config) -> int:
        return config.num_experts

    @staticmethod
    def expert_size(config) -> int:
        return config.moe_intermediate_size


class AllSparseMoEForCausalLM(SparseMoEForCausalLM):
    """Experts on every layer, as Mixtral's config names them: num_local_experts of
    intermediate_size each (Mixtral, Granite-MoE, gpt-oss)."""

    @staticmethod
    def is_sparse(config, index: int) -> bool:
        return True

    @staticmethod
    def num_experts(config) -> int:
        return config.num_local_experts

    @staticmethod
    def expert_size(config) -> int:
        return config.intermediate_size
