from __future__ import annotations

from miles_core.run.runtime import RLRuntime
from tasks._task import step_task


@step_task(name="evaluate_policy")
def evaluate_policy(rt: RLRuntime, version: int) -> None:
    """Scores policy version `version`: now on the rollout engines (shared mode, agentic runs),
    or in the background from its checkpoint (dedicated / external); training goes on."""
    rt.submit_evaluation(version)


@step_task(name="collect_evaluations")
def collect_evaluations(rt: RLRuntime, wait: bool = False) -> list[tuple[int, dict[str, float]]]:
    """The evaluations that ended since the last call, as (version, eval/* metrics); with
    `wait`, after the pending ones end (each bounded by eval.timeout_s)."""
    return rt.finished_evaluations(wait)
