"""RL training flow: one Prefect flow per run; in sync mode one task per step.

    check inputs → MLflow run → [SFT warm start] → prepare runtime → for each step:
        rl_step (rollout → train → weight update) → [save_checkpoint] → log metrics
        → [evaluate_policy] (eval.mode or agent.eval_episodes) → log finished evaluations
    → final checkpoint, pending evaluations, reward curve, MLflow run closed

In one_step_off / fully_async the same steps, in the same order, run inside four concurrent
long-running tasks (rollout producer, training, weight update, evaluation): flows/rl_async.py.

The config (a pydantic model) is the parameter, so the Prefect UI renders it as a form.
Simplifications, stated: sync mode (rollout, then train, then push); one embedded engine in this
process; GRPO advantages; the trainer runs here (rank 0) and, under torchrun, on follower ranks.
"""

from __future__ import annotations

import shutil
import time

from prefect import flow

from flows.rl_async import long_running, train_concurrently
from flows.sft import sft
from miles_core.config import RunConfig
from miles_core.preflight import run_names
from miles_core.progress import reporter
from miles_core.run_lock import RunClaim
from miles_core.runtime import new_workdir
from miles_core.steplog import StepLog
from tasks import (
    check_inputs,
    collect_evaluations,
    evaluate_policy,
    prepare_model,
    prepare_runtime,
    resumed_config,
    rl_step,
    save_checkpoint,
    start_tracking,
)


@flow(name="rl-train", log_prints=True)
def rl_train(
    config: RunConfig, resume: bool = False, resume_step: int | None = None
) -> dict[str, float | str]:
    """`resume`: continue the run's latest checkpoint; `resume_step`: continue checkpoint
    step N instead (implies resume). Either way the loop starts at the saved step + 1 and
    `train.num_steps` stays the run's total."""
    resume = resume or resume_step is not None
    check_inputs(config, resume, resume_step)
    # the run's names are its own until it ends, also if it fails (a no-op under `miles train`,
    # which claimed them before Prefect started): run_lock.py
    with RunClaim(config.checkpoint.root, run_names(config), config.checkpoint.storage_options):
        return _train(config, resume, resume_step)


def _train(config: RunConfig, resume: bool, resume_step: int | None) -> dict[str, float | str]:
    tracker = start_tracking(
        config, config.tracking.run_name or config.name, resume=resume, resume_step=resume_step
    )
    rt = None
    workdir = new_workdir()  # the starting model (a random init, a download); removed at the end
    try:
        if resume:
            config = resumed_config(config, resume_step)  # the model the run started from
        elif config.sft is not None:
            config = config.with_model_path(sft(config, parent_run_id=tracker.run_id))
        rt = prepare_runtime(config, prepare_model(config, workdir), tracker, resume, resume_step)

        log = StepLog(tracker, reporter(), config.train.num_steps)
        if long_running(config):  # async modes: concurrent long-running tasks (rl_async.py)
            train_concurrently(rt, log)
        else:  # sync: one short task per step (rollout → train → push inside: tasks/step.py)
            if rt.start_step == 0 and rt.eval_due(0):  # a resumed run scored its start already
                evaluate_policy(rt, 0)
            for step in range(rt.start_step, config.train.num_steps):
                t0 = time.perf_counter()
                rollout, train_metrics, sync_metrics = rl_step(rt, step)
                phases = rollout.metrics | train_metrics | sync_metrics  # kept in the checkpoint
                saved = save_checkpoint(rt, step, phases) if rt.is_save_step(step) else {}
                log.step(step, t0, rollout.metrics, train_metrics, sync_metrics, saved)
                if rt.eval_due(step + 1):  # the policy after step + 1 training steps
                    evaluate_policy(rt, step + 1)
                if rt.evaluation is not None:
                    for version, metrics in collect_evaluations(rt):
                        log.evaluation(version, metrics)

            if rt.last_saved_step != config.train.num_steps - 1:
                save_checkpoint(rt, config.train.num_steps - 1)
            if rt.evaluation is not None:  # the evaluations still pending
                for version, metrics in collect_evaluations(rt, wait=True):
                    log.evaluation(version, metrics)
    except BaseException:
        tracker.finish("FAILED")
        raise
    finally:  # engine servers, producer threads and temp folders go with the run, also if it fails
        try:
            if rt is not None:
                rt.close()
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    return log.finish()
