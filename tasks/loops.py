"""The run's long-running tasks: one per loop of `miles_core/run/loops.py`, submitted together
by `flows/rl_loops.py`, Running side by side for the run's duration (sync mode: `train_loop`
alone). Inside them the phases are the phase tasks' functions, called directly (no task run per
phase per step). Each returns "done", or "stopped" when another loop failed; the failing one
raises."""

from __future__ import annotations

from miles_core.run.loops import RunLoops
from tasks._task import step_task


@step_task(name="rollout_loop")
def rollout_loop(loops: RunLoops) -> str:
    """The rollout producer's loop: admits groups and generates them on the engines, from the
    trainer's first rollout until training and evaluation end (or a loop fails)."""
    return loops.run("rollout")


@step_task(name="train_loop")
def train_loop(loops: RunLoops) -> str:
    """Every step: take the step's rollout, train, hand the policy to the weight update, save on
    save steps, log the step's metrics, tell the evaluation; then the final checkpoint. In sync
    mode it generates the rollout, pushes and evaluates itself, in that order."""
    return loops.run("train")


@step_task(name="weight_update_loop")
def weight_update_loop(loops: RunLoops) -> str:
    """Pushes each new policy to the engines as the next policy version."""
    return loops.run("weights")


@step_task(name="evaluation_loop")
def evaluation_loop(loops: RunLoops) -> str:
    """Submits the policy versions due for evaluation, logs finished evaluations, and waits
    for the pending ones after training."""
    return loops.run("evaluate")


LOOP_TASKS = {
    "rollout": rollout_loop,
    "train": train_loop,
    "weights": weight_update_loop,
    "evaluate": evaluation_loop,
}
