from __future__ import annotations

from miles_core.run.runtime import RLRuntime
from miles_core.weights.sync import WeightSnapshot
from tasks._task import step_task


@step_task(name="update_weights")
def update_weights(rt: RLRuntime, snapshot: WeightSnapshot | None = None) -> dict[str, float]:
    """Pushes the trainer's weights to the engines as the next policy version (or a snapshot
    of them the trainer handed over, as its version)."""
    return rt.update_weights(snapshot)
