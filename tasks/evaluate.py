from __future__ import annotations

from miles_core.runtime import RLRuntime
from tasks._task import step_task


@step_task(name="evaluate_policy")
def evaluate_policy(rt: RLRuntime) -> dict[str, float]:
    """Agent episodes on the fixed evaluation tasks with the policy the engines serve now."""
    return rt.evaluate()
