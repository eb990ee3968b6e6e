"""The run's shape: long-running Prefect tasks around the one `RLRuntime`
(`miles_core/run/loops.py` has the loops, `tasks/loops.py` the tasks), so the flow run's page
shows them Running for the run's duration; each step's progress goes to MLflow and the logs
(`StepLog`). In `one_step_off` / `fully_async` the rollout producer, training, weight update and
evaluation run side by side; in sync mode `train_loop` alone runs each step's rollout → train →
push in order (nothing would overlap, and a task run per step costs ≈4.5 ms). `train_loop` runs
on the flow's thread, the others on its task runner."""

from __future__ import annotations

from prefect.futures import wait

from miles_core.run.loops import Phases, RunLoops
from miles_core.run.runtime import RLRuntime
from miles_core.run.steplog import StepLog
from tasks import (
    collect_evaluations,
    evaluate_policy,
    rollout_batch,
    save_checkpoint,
    train_step,
    update_weights,
)
from tasks.loops import LOOP_TASKS, train_loop

# the phase tasks' own functions (`Task.fn`), called inside the long-running tasks: a task run
# per phase per step cost ≈4.5 ms each (measured at the tiny preset: one_step_off 0.220 → 0.148
# s/step, fully_async 0.304 → 0.162; sync's one task per step was 4 % of its 0.20 s step)
PHASES = Phases(
    rollout=rollout_batch.fn,
    train=train_step.fn,
    push=update_weights.fn,
    save=save_checkpoint.fn,
    evaluate=evaluate_policy.fn,
    collect=collect_evaluations.fn,
)
STOP_GRACE_S = 120.0  # how long an interrupted flow waits for its loops to return


def run_loops(rt: RLRuntime, log: StepLog) -> None:
    """Runs `train_loop` on the flow's own thread and submits the other loops on the flow's
    thread-pool task runner; re-raises the first loop's failure once the others have stopped.

    Why the trainer stays on the flow's thread (the one that built the model): GNU OpenMP keeps
    a thread team per thread that ran parallel ops, and once a process holds more of its threads
    than cores it stops spinning between ops, so every op of a second computing thread pays a
    wake-up. Measured at the tiny preset, one process, the same steps: train 0.068 s on the
    building thread, 0.143 s on a task runner's thread (rollout alike: 0.063 / 0.074)."""
    loops = RunLoops(rt, log, PHASES)
    futures = [LOOP_TASKS[name].submit(loops) for name in loops.loops if name != "train"]
    try:
        trained = train_loop(loops, return_state=True)  # a loop's failure is loops.error
        if loops.error is None and not trained.is_completed():
            trained.result()  # it failed outside its loop (Prefect itself): raises
    except BaseException as e:  # interrupted here: the loops stop, then the run fails
        loops.fail(e)
        wait(futures, timeout=STOP_GRACE_S)
        raise
    wait(futures)
    if loops.error is not None:
        raise loops.error
    for future in futures:
        future.result()  # a task that failed outside its loop (Prefect itself)
