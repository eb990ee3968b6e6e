from __future__ import annotations

import time

from miles_core.rollout.rollout_fn import RolloutResult
from miles_core.run.runtime import RLRuntime
from tasks._task import step_task


@step_task(name="rollout_batch")
def rollout_batch(rt: RLRuntime, step: int) -> RolloutResult:
    """Generates one rollout batch (groups of samples with rewards) on the engines."""
    t0 = time.perf_counter()
    result = rt.rollout(step)
    result.metrics["perf/rollout_time_s"] = time.perf_counter() - t0
    return result
