"""Tiny presets for CPU runs (random init, seeded): dense Qwen3, and mixture-of-experts shapes.

A preset names its model family (`models/<family>/`: which HF architecture it builds) and sizes;
every family gets the same attention shape, tied embeddings and the run's tokenizer ids. MoE
presets add the routed experts (`num_experts`, `top_k`, `moe_intermediate_size`), and for the
DeepSeek/GLM style a shared expert beside them (`shared_experts`) with the first
`dense_layers` layers dense."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelPreset:
    hidden_size: int
    intermediate_size: int  # the dense MLP's (dense layers of an MoE preset too)
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 512
    family: str = "qwen3"
    num_experts: int = 0  # routed experts per MoE layer (0: dense)
    top_k: int = 0  # experts each token is routed to
    moe_intermediate_size: int = 0  # one expert's MLP width
    shared_experts: int = 0  # experts every token goes through (glm4_moe)
    dense_layers: int = 0  # leading dense layers (glm4_moe's first_k_dense_replace)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


PRESETS: dict[str, ModelPreset] = {
    # ≈0.11M parameters
    "tiny": ModelPreset(64, 192, 2, 4, 2, 16),
    # ≈4.0M parameters
    "small": ModelPreset(256, 1024, 4, 4, 2, 64),
    # ≈31M parameters
    "medium": ModelPreset(512, 1536, 10, 8, 4, 64),
    # Qwen3-MoE: 8 experts, top-2, softmax routing with the top-k renormalised; ≈0.25M
    "tiny-moe": ModelPreset(
        64, 192, 2, 4, 2, 16, family="qwen3_moe", num_experts=8, top_k=2, moe_intermediate_size=64
    ),
    # ≈10M parameters (≈3.4M active per token)
    "small-moe": ModelPreset(
        256,
        1024,
        4,
        4,
        2,
        64,
        family="qwen3_moe",
        num_experts=8,
        top_k=2,
        moe_intermediate_size=384,
    ),  # fmt: skip
    # GLM4-MoE (DeepSeek-V3 style): a dense first layer, then 8 routed experts, top-2 by sigmoid
    # score with a correction bias, plus one shared expert; ≈0.27M
    "tiny-moe-shared": ModelPreset(
        64,
        192,
        3,
        4,
        2,
        16,
        family="glm4_moe",
        num_experts=8,
        top_k=2,
        moe_intermediate_size=64,
        shared_experts=1,
        dense_layers=1,
    ),  # fmt: skip
}
