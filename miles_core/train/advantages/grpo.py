"""GRPO: each reward minus its group's mean, divided by the group's standard deviation
(`normalize_std: false` keeps the mean-centred rewards, as Dr. GRPO does)."""

from __future__ import annotations

import torch
from pydantic import Field

from miles_core.plugins import PluginOptions
from miles_core.train.advantage import ADVANTAGES, GroupEstimator


class GRPOOptions(PluginOptions):
    normalize_std: bool = Field(True, description="divide by the group's reward std")
    eps: float = Field(1e-6, gt=0, description="added to the std")


@ADVANTAGES.register("grpo")
class GRPO(GroupEstimator):
    Options = GRPOOptions

    def group(self, rewards: torch.Tensor, options: GRPOOptions) -> torch.Tensor:
        a = rewards - rewards.mean()
        if options.normalize_std and len(rewards) > 1:
            a = a / (rewards.std(unbiased=True) + options.eps)
        return a
