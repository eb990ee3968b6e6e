from __future__ import annotations

import time

from miles_core.runtime import RLRuntime
from tasks._task import step_task


@step_task(name="save_checkpoint")
def save_checkpoint(rt: RLRuntime, step: int) -> dict[str, float]:
    """Writes the checkpoint of `step` and records it as a policy version in MLflow.
    No Prefect retries: the save runs collectives on every trainer rank, and a retry from rank 0
    alone would not line up with them."""
    t0 = time.perf_counter()
    rt.save(step)
    return {"perf/checkpoint_time_s": time.perf_counter() - t0}
