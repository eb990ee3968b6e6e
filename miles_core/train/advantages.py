"""Advantage estimators. GRPO: each reward minus its group's mean, divided by the group's std.

The statistics are over a group's rollouts, not its samples: an agent episode recorded as
several leaves (siblings sharing a rollout id, one reward) counts once, so a harness that
branches a lot does not pull its group's baseline toward its own reward. Every leaf gets its
rollout's advantage. With one sample per rollout (plain RL) the two are the same. FAILED
samples (a reward function or an agent that failed) are left out of the statistics and get
advantage 0: they train nothing and do not drag their siblings' baseline toward 0.
"""

from __future__ import annotations

import torch

from miles_core.types import SampleGroup, Status


def grpo_advantages(
    groups: list[SampleGroup], normalize_std: bool = True, eps: float = 1e-6
) -> list[float]:
    """One scalar advantage per sample, in the order of the groups' samples."""
    out: list[float] = []
    for g in groups:
        rewards: dict[str, float] = {}  # rollout id → its reward, in first-seen order
        for s in g.samples:
            if s.status != Status.FAILED:  # failed: trains nothing, and is not a baseline
                rewards.setdefault(s.rollout_id, float(s.reward))
        by_rollout: dict[str, float] = {}
        if rewards:
            r = torch.tensor(list(rewards.values()), dtype=torch.float64)
            a = r - r.mean()
            if normalize_std and len(r) > 1:
                a = a / (r.std(unbiased=True) + eps)
            by_rollout = dict(zip(rewards, a.tolist(), strict=True))
        out.extend(by_rollout.get(s.rollout_id, 0.0) for s in g.samples)
    return out


def rollout_slices(rollout_ids: list[str], rollouts_per_slice: int) -> list[tuple[int, int]]:
    """[start, end) row ranges of consecutive rollouts, `rollouts_per_slice` whole rollouts each
    (a rollout's leaves are never split between two optimizer steps). A rollout's samples must
    be next to each other (rollout functions emit them so)."""
    bounds, count, start = [], 0, 0
    seen: set[str] = set()
    for i, rid in enumerate(rollout_ids):
        if i and rid != rollout_ids[i - 1]:
            if rid in seen:
                raise ValueError(f"rollout {rid!r}: its samples are not next to each other")
            count += 1
            if count == rollouts_per_slice:
                bounds.append((start, i))
                start, count = i, 0
        seen.add(rid)
    if rollout_ids:
        bounds.append((start, len(rollout_ids)))
    return bounds
