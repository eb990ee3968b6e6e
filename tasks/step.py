"""Sync mode's one task per step: rollout → train → weight update, the three phase tasks' own
functions called in order inside it. A Prefect task run costs ≈ 4.5 ms of Prefect work on the
flow's thread (and events for the API server), so one run per step instead of three keeps the
orchestration share of a tiny step under 3 % (benchmarks/step_time.py); each phase's time is in
MLflow (`perf/rollout_time_s`, `perf/train_time_s`, `perf/weight_sync_time_s`)."""

from __future__ import annotations

from miles_core.rollout.rollout_fn import RolloutResult
from miles_core.runtime import RLRuntime
from tasks._task import step_task
from tasks.rollout import rollout_batch
from tasks.train import train_step
from tasks.weights import update_weights


@step_task(name="rl_step", task_run_name="step-{step}")
def rl_step(rt: RLRuntime, step: int) -> tuple[RolloutResult, dict[str, float], dict[str, float]]:
    """One sync step: its rollout, its optimizer step(s), the push of the new policy."""
    rollout = rollout_batch.fn(rt, step)
    train_metrics = train_step.fn(rt, rollout)
    sync_metrics = update_weights.fn(rt)
    return rollout, train_metrics, sync_metrics
