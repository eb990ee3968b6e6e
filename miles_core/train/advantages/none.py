"""`none`: every advantage 0, for runs whose signal is an advantage transform alone (pure
on-policy distillation: `train.advantage_transforms: {opd: ...}` with no task reward)."""

from __future__ import annotations

from miles_core.train.advantage import ADVANTAGES


@ADVANTAGES.register("none")
class NoAdvantage:
    min_group = 1

    def __call__(self, groups, options) -> list[float]:
        return [0.0 for g in groups for _ in g.samples]
