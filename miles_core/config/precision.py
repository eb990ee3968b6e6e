"""The `precision:` section: what stays in high precision when `rollout.precision` quantizes the
linear weights. One keep-list, applied alike by checkpoint conversion, the trainer's QAT, the
engine and every weight push (miles_core/precision/keep.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from miles_core.config.base import Strict

# groups of linear weights a keep-list may name (embeddings and norms are not linear layers:
# they are never quantized)
Module = Literal["lm_head", "router", "attention", "dense_mlp", "experts", "shared_experts"]


class KeepBF16(Strict):
    modules: list[Module] = Field(
        default_factory=lambda: ["lm_head", "router"],
        description="groups of linear weights kept in high precision: lm_head, router (MoE "
        "gate), attention (q/k/v/o), dense_mlp (gate/up/down of dense layers), experts (routed), "
        "shared_experts; e.g. [lm_head, router, attention, dense_mlp] quantizes experts only",
    )
    first_layers: int = Field(0, ge=0, description="the first N decoder layers stay unquantized")
    last_layers: int = Field(0, ge=0, description="the last N decoder layers stay unquantized")
    names: list[str] = Field(
        default_factory=list,
        description="more tensors kept: substrings of HF tensor names (each must match one)",
    )


class PrecisionConfig(Strict):
    keep_bf16: KeepBF16 = Field(default_factory=KeepBF16)

    @model_validator(mode="after")
    def _names_not_empty(self) -> PrecisionConfig:
        if any(not n for n in self.keep_bf16.names):
            raise ValueError("precision.keep_bf16.names: an empty name would keep every tensor")
        return self
