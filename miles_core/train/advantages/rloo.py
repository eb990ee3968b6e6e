"""RLOO (REINFORCE leave-one-out): each reward minus the mean of the others in its group,
r_i - (sum_j r_j - r_i) / (n - 1); a group of one rollout has no baseline and gets 0."""

from __future__ import annotations

import torch

from miles_core.train.advantage import ADVANTAGES, GroupEstimator


@ADVANTAGES.register("rloo")
class RLOO(GroupEstimator):
    def group(self, rewards: torch.Tensor, options: object) -> torch.Tensor:
        n = len(rewards)
        if n < 2:
            return torch.zeros_like(rewards)
        return rewards - (rewards.sum() - rewards) / (n - 1)
