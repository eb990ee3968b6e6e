from __future__ import annotations

import time

from miles_core.rollout.rollout_fn import RolloutResult
from miles_core.run.runtime import RLRuntime
from tasks._task import step_task


@step_task(name="train_step")
def train_step(rt: RLRuntime, result: RolloutResult) -> dict[str, float]:
    """Advantages, log-prob recompute, and the optimizer step(s) on one rollout batch."""
    t0 = time.perf_counter()
    metrics = rt.train(result)
    metrics["perf/train_time_s"] = time.perf_counter() - t0
    return metrics
