"""Advantage estimators: one scalar advantage per sample from its group's rewards.

An estimator is a class in `train/advantages/` (`@ADVANTAGES.register(name)`, chosen by
`train.advantage_estimator`) or one named by import path; its settings are its `Options`
(`train.advantage_estimator_options`). Most are a function of one group's rewards, written as
`group(rewards, options)` on a `GroupEstimator`, which handles what every estimator shares:

The statistics are over a group's rollouts, not its samples: an agent episode recorded as
several leaves (siblings sharing a rollout id, one reward) counts once, so a harness that
branches a lot does not pull its group's baseline toward its own reward. Every leaf gets its
rollout's advantage. With one sample per rollout (plain RL) the two are the same. FAILED
samples (a reward function or an agent that failed) are left out of the statistics and get
advantage 0: they train nothing and do not drag their siblings' baseline toward 0.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from miles_core.plugins import NoOptions, PluginOptions, Registry
from miles_core.types import SampleGroup, Status


class AdvantageEstimator(Protocol):
    Options: type[PluginOptions]
    min_group: int  # the fewest samples per prompt it can compare (rollout.n_samples_per_prompt)

    def __call__(self, groups: list[SampleGroup], options: Any) -> list[float]:
        """One advantage per sample, in the order of the groups' samples."""
        ...


class GroupEstimator:
    """An estimator written per group: `group(rewards, options)` maps the rewards of a group's
    rollouts (float64, at least one) to their advantages."""

    Options: type[PluginOptions] = NoOptions
    min_group = 2

    def group(self, rewards: torch.Tensor, options: Any) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, groups: list[SampleGroup], options: Any) -> list[float]:
        out: list[float] = []
        for g in groups:
            rewards: dict[str, float] = {}  # rollout id → its reward, in first-seen order
            for s in g.samples:
                if s.status != Status.FAILED:  # failed: trains nothing, and is not a baseline
                    rewards.setdefault(s.rollout_id, float(s.reward))
            by_rollout: dict[str, float] = {}
            if rewards:
                r = torch.tensor(list(rewards.values()), dtype=torch.float64)
                a = self.group(r, options)
                by_rollout = dict(zip(rewards, a.tolist(), strict=True))
            out.extend(by_rollout.get(s.rollout_id, 0.0) for s in g.samples)
        return out


def _estimator(obj: Any, name: str) -> Any:
    """A registered or imported estimator as an instance (a class is built without arguments)."""
    est = obj() if isinstance(obj, type) else obj
    if not callable(est):
        raise ValueError(f"advantage estimator {name!r} is not callable: {obj!r}")
    return est


ADVANTAGES: Registry[Any] = Registry(
    "advantage estimator",
    "train.advantage_estimator",
    package="miles_core.train.advantages",
    example="package.module:Class",
    load=_estimator,
)
