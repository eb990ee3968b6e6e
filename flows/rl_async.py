"""The async modes' run shape (`rollout.mode` one_step_off / fully_async): the rollout producer,
training, weight update and evaluation as concurrent long-running Prefect tasks around the one
`RLRuntime` (`miles_core/run_loops.py` has the loops, `tasks/loops.py` the tasks), so the flow
run's page shows them Running together for the run's duration; each step's progress goes to
MLflow and the logs (`StepLog`). Sync mode keeps the plain loop of step tasks in
`flows/rl_train.py`."""

from __future__ import annotations

from prefect.futures import wait

from miles_core.run_loops import Phases, RunLoops
from miles_core.runtime import RLRuntime
from miles_core.steplog import StepLog
from tasks import (
    collect_evaluations,
    evaluate_policy,
    rollout_batch,
    save_checkpoint,
    train_step,
    update_weights,
)
from tasks.loops import LOOP_TASKS

# the step tasks' own functions (`Task.fn`), called inside the long-running tasks: the same
# phase code and metrics as sync mode's step tasks, without a task run per phase per step
# (measured: one_step_off 0.220 → 0.148 s/step, fully_async 0.304 → 0.162 at the tiny preset)
PHASES = Phases(
    rollout=rollout_batch.fn,
    train=train_step.fn,
    push=update_weights.fn,
    save=save_checkpoint.fn,
    evaluate=evaluate_policy.fn,
    collect=collect_evaluations.fn,
)
STOP_GRACE_S = 120.0  # how long an interrupted flow waits for its loops to return


def long_running(config) -> bool:
    """Whether the run takes the long-running shape: the async modes (a rollout producer)."""
    return config.rollout.mode != "sync" and config.agent.function is None


def train_concurrently(rt: RLRuntime, log: StepLog) -> None:
    """Submits the loops (on the flow's thread-pool task runner) and waits for all of them;
    re-raises the first loop's failure once the others have stopped."""
    loops = RunLoops(rt, log, PHASES)
    futures = [LOOP_TASKS[name].submit(loops) for name in loops.loops]
    try:
        wait(futures)
    except BaseException as e:  # interrupted here: the loops stop, then the run fails
        loops.fail(e)
        wait(futures, timeout=STOP_GRACE_S)
        raise
    if loops.error is not None:
        raise loops.error
    for future in futures:
        future.result()  # a task that failed outside its loop (Prefect itself)
