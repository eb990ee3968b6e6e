"""RL training flow: one Prefect flow per run, its steps inside long-running tasks.

    check inputs → MLflow run → [SFT warm start] → prepare runtime → train_loop, for each step:
        rollout → train → weight update → [save checkpoint] → log metrics
        → [evaluate] (eval.mode or agent.eval_episodes) → log finished evaluations
    → final checkpoint, pending evaluations, reward curve, MLflow run closed

In one_step_off / fully_async the same steps, in the same order, run across four concurrent
long-running tasks (rollout producer, training, weight update, evaluation): flows/rl_loops.py.

The config (a pydantic model) is the parameter, so the Prefect UI renders it as a form.
Simplifications, stated: sync mode (rollout, then train, then push); one embedded engine in this
process; GRPO advantages; the trainer runs here (rank 0) and, under torchrun, on follower ranks.
"""

from __future__ import annotations

import shutil

from prefect import flow

from flows.prefect_server import send_to_api
from flows.rl_loops import run_loops
from flows.sft import sft
from miles_core.checkpoint.run_lock import RunClaim
from miles_core.config import RunConfig
from miles_core.run.preflight import run_names
from miles_core.run.progress import reporter
from miles_core.run.runtime import new_workdir
from miles_core.run.steplog import StepLog
from miles_core.run.timeline import mark
from tasks import check_inputs, prepare_model, prepare_runtime, resumed_config, start_tracking


@flow(name="rl-train", log_prints=True)
def rl_train(
    config: RunConfig, resume: bool = False, resume_step: int | None = None
) -> dict[str, float | str]:
    """`resume`: continue the run's latest checkpoint; `resume_step`: continue checkpoint
    step N instead (implies resume). Either way the loop starts at the saved step + 1 and
    `train.num_steps` stays the run's total."""
    resume = resume or resume_step is not None
    send_to_api("miles")  # the step lines, in the flow run's logs in the Prefect UI
    check_inputs(config, resume, resume_step)
    # the run's names are its own until it ends, also if it fails (a no-op under `miles train`,
    # which claimed them before Prefect started): checkpoint/run_lock.py
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
        elif config.sft is not None:  # a warm start: trained here, or an earlier run's result
            warm = config.sft.reuse or sft(config, parent_run_id=tracker.run_id)
            config = config.with_model_path(warm)
        model_dir = prepare_model(config, workdir, tracker)
        rt = prepare_runtime(config, model_dir, tracker, resume, resume_step)

        log = StepLog(tracker, reporter(), config.train.num_steps)
        mark("steps_start")
        run_loops(rt, log)  # the steps, in long-running tasks (flows/rl_loops.py)
        mark("steps_end")
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
