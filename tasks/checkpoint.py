from __future__ import annotations

import logging
import time

from miles_core.checkpoint.store import CheckpointSaveError
from miles_core.run.runtime import RLRuntime
from tasks._task import step_task

log = logging.getLogger("miles")


@step_task(name="save_checkpoint")
def save_checkpoint(
    rt: RLRuntime, step: int, metrics: dict[str, float] | None = None
) -> dict[str, float]:
    """Writes the checkpoint of `step` (with the step's phase `metrics`, which a resume logs if
    this process died before flushing them) and records it as a policy version in MLflow.
    No Prefect retries: the save runs collectives on every trainer rank, and a retry from rank 0
    alone would not line up with them. A save that fails before the last step (disk full, a
    storage outage) is logged and training goes on (the next save step tries again); the last
    step's save must succeed."""
    t0 = time.perf_counter()
    try:
        rt.save(step, metrics)
    except CheckpointSaveError as e:
        if step >= rt.config.train.num_steps - 1:
            raise
        log.warning("%s; training goes on, the next save step retries", e)
        return {"checkpoint/save_failed": 1.0, "perf/checkpoint_time_s": time.perf_counter() - t0}
    return {"perf/checkpoint_time_s": time.perf_counter() - t0}
