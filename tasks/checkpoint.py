from __future__ import annotations

from miles_core.runtime import RLRuntime
from tasks._task import step_task


@step_task(name="save_checkpoint", retries=2, retry_delay_seconds=5)
def save_checkpoint(rt: RLRuntime, step: int) -> str:
    """Writes the checkpoint of `step` and records it as a policy version in MLflow."""
    return rt.save(step)
