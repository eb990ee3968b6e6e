from __future__ import annotations

from miles_core.run.runtime import RLRuntime
from tasks._task import step_task


@step_task(name="update_weights")
def update_weights(rt: RLRuntime) -> dict[str, float]:
    """Pushes the trainer's weights to the engines as the next policy version."""
    return rt.update_weights()
