"""Advantage estimators. GRPO: each reward minus its group's mean, divided by the group's std."""

from __future__ import annotations

import torch

from miles_core.types import SampleGroup


def grpo_advantages(
    groups: list[SampleGroup], normalize_std: bool = True, eps: float = 1e-6
) -> list[float]:
    """One scalar advantage per sample, in the order of the groups' samples."""
    out: list[float] = []
    for g in groups:
        r = torch.tensor(g.rewards, dtype=torch.float64)
        a = r - r.mean()
        if normalize_std and len(r) > 1:
            a = a / (r.std(unbiased=True) + eps)
        out.extend(a.tolist())
    return out
