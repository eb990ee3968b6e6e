"""An advantage estimator defined outside miles_core, as a user would write one: named by import
path (`train.advantage_estimator: tests.plugins.estimator:RankEstimator`) with an option of its
own (`train.advantage_estimator_options.scale`), nothing registered inside the package.

Rank-based advantages: a group's rollouts ranked by reward, mapped evenly onto [-scale, scale]
(ties share their mean rank), so the size of a reward gap does not matter, only the order. It
notes each group's advantages in `CALLS`, so a test sees the run trained with them.
"""

from __future__ import annotations

import torch
from pydantic import Field

from miles_core.plugins import PluginOptions
from miles_core.train.advantage import GroupEstimator

CALLS: list[list[float]] = []


class RankOptions(PluginOptions):
    scale: float = Field(1.0, gt=0, description="the best rollout's advantage")


class RankEstimator(GroupEstimator):
    Options = RankOptions

    def group(self, rewards: torch.Tensor, options: RankOptions) -> torch.Tensor:
        n = len(rewards)
        if n < 2:
            return torch.zeros_like(rewards)
        below = (rewards[None, :] < rewards[:, None]).sum(1).double()
        ties = (rewards[None, :] == rewards[:, None]).sum(1).double()
        rank = below + (ties - 1) / 2  # 0 … n-1, ties averaged
        advantages = options.scale * (2 * rank / (n - 1) - 1)
        CALLS.append(advantages.tolist())
        return advantages
