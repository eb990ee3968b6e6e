"""RL training flow: one Prefect flow per run, one task per phase of each step.

    [sft warm start] → prepare runtime → for each step:
        rollout_batch → train_step → update_weights → [save_checkpoint] → log metrics
    → final checkpoint, reward curve, MLflow run closed

The config (a pydantic model) is the only parameter, so the Prefect UI renders it as a form.
Simplifications, stated: sync mode (rollout, then train, then push); one embedded engine in this
process; GRPO advantages; the trainer runs here (rank 0) and, under torchrun, on follower ranks.
"""

from __future__ import annotations

import time

from prefect import flow

from flows.sft import sft
from miles_core.config import RunConfig
from miles_core.progress import reporter
from miles_core.runtime import new_workdir
from miles_core.steplog import StepLog
from tasks import (
    prepare_runtime,
    rollout_batch,
    save_checkpoint,
    start_tracking,
    train_step,
    update_weights,
)
from tasks.setup import prepare_model


@flow(name="rl-train", log_prints=True)
def rl_train(config: RunConfig, resume: bool = False) -> dict[str, float]:
    tracker = start_tracking(config, config.tracking.run_name or config.name)
    if config.sft is not None and not resume:
        sft_uri = sft(config, parent_run_id=tracker.run_id)
        config = config.model_copy(
            update={"model": config.model.model_copy(update={"path": sft_uri})}
        )
    model_dir = prepare_model(config, new_workdir())
    rt = prepare_runtime(config, model_dir, tracker, resume)

    log = StepLog(tracker, reporter(), config.train.num_steps)
    for step in range(rt.start_step, config.train.num_steps):
        t0 = time.perf_counter()
        rollout = rollout_batch(rt, step)
        train_metrics = train_step(rt, rollout)
        sync_metrics = update_weights(rt)
        saved = None
        if config.checkpoint.interval and (step + 1) % config.checkpoint.interval == 0:
            saved = save_checkpoint(rt, step)
        log.step(
            step,
            t0,
            rollout.metrics,
            train_metrics,
            sync_metrics,
            policy_version=rt.policy_version,
            saved=saved,
        )

    if not config.checkpoint.interval or config.train.num_steps % config.checkpoint.interval:
        save_checkpoint(rt, config.train.num_steps - 1)
    rt.close()
    return log.finish()
