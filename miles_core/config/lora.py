"""The `train.lora:` section: LoRA adapters trained instead of the model (miles_core/lora/).

The base stays frozen and is never merged; only the adapters get gradients and optimizer state,
and only they travel to the engines, which serve them unmerged, per request."""

from __future__ import annotations

import math
import re
from typing import Literal

from pydantic import Field, field_validator

from miles_core.config.base import Strict

# adapter names travel in tensor names (`lora.<name>.<module>...`) and request fields
ADAPTER_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


class LoraSettings(Strict):
    rank: int = Field(8, description="the adapters' rank r (> 0)")
    alpha: float = Field(16.0, gt=0, description="scaling numerator: ΔW = B·A · alpha / r")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear",
        description="the linear modules adapted: leaf names (q_proj, v_proj, ...) or "
        "all-linear (every linear layer of the decoder; never the output layer)",
    )
    exclude_modules: list[str] = Field(
        default_factory=list, description="leaf names left out of target_modules"
    )
    rslora: bool = Field(False, description="rank-stabilised scaling alpha / sqrt(r)")
    adapters: list[str] = Field(
        default_factory=lambda: ["default"],
        description="the adapters trained, named in requests, pushes and checkpoints; with "
        "several (multi-LoRA), each data row names its adapter in its 'adapter' field, and each "
        "adapter has its own optimizer state and steps on its own rows alone",
    )

    @field_validator("rank")
    @classmethod
    def _positive_rank(cls, v: int) -> int:
        if v <= 0:
            raise ValueError(f"train.lora.rank must be a positive integer, got {v}")
        return v

    @field_validator("adapters")
    @classmethod
    def _names(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("train.lora.adapters: name at least one adapter")
        bad = [n for n in v if not ADAPTER_NAME.fullmatch(n)]
        if bad:
            raise ValueError(
                f"train.lora.adapters: {bad[0]!r} is not a name of 1-64 letters, digits, '_' or '-'"
            )
        if len(set(v)) != len(v):
            raise ValueError("train.lora.adapters: a name is listed twice")
        return v

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    @property
    def adapter(self) -> str:
        """The adapter of a request whose prompt names none (the first)."""
        return self.adapters[0]
