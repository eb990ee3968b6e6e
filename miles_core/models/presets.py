"""Tiny Qwen3-architecture presets for CPU runs (random init, seeded)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelPreset:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 512


PRESETS: dict[str, ModelPreset] = {
    # ≈0.11M parameters
    "tiny": ModelPreset(64, 192, 2, 4, 2, 16),
    # ≈4.0M parameters
    "small": ModelPreset(256, 1024, 4, 4, 2, 64),
    # ≈31M parameters
    "medium": ModelPreset(512, 1536, 10, 8, 4, 64),
}
