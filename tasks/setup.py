from __future__ import annotations

from pathlib import Path

from prefect.runtime import flow_run

from miles_core.config import RunConfig
from miles_core.run.preflight import clear_previous_checkpoints, preflight
from miles_core.run.runtime import RLRuntime, latest_state, prepare_model_dir
from miles_core.run.tracking import Tracker
from tasks._task import step_task


@step_task(name="check_inputs")
def check_inputs(config: RunConfig, resume: bool = False, resume_step: int | None = None) -> None:
    """Dataset rows, SFT answers, the checkpoint to resume: refused here, before anything starts.
    With checkpoint.overwrite, a new run first removes the earlier checkpoints of its name."""
    preflight(config, resume, resume_step)
    if config.checkpoint.overwrite and not resume:
        clear_previous_checkpoints(config)


@step_task(name="resumed_config")
def resumed_config(config: RunConfig, resume_step: int | None = None) -> RunConfig:
    """On resume: the config starting from the model the run started from (e.g. its SFT output,
    an image run's pretrained model)."""
    start = latest_state(config, resume_step).get("init_model")
    return config.with_start_model(start)


@step_task(name="start_tracking")
def start_tracking(
    config: RunConfig,
    run_name: str,
    parent_run_id: str | None = None,
    resume: bool = False,
    resume_step: int | None = None,
) -> Tracker:
    """One MLflow run per training run; params are the flattened config. On resume, the run
    recorded in the latest checkpoint is re-attached, so its curves continue."""
    tags = {"prefect.flow_run_id": str(flow_run.id or "")}
    if not resume:
        tags["miles.policy_version"] = "0"
    return Tracker(
        config.tracking.tracking_uri,
        config.tracking.experiment,
        run_name,
        params=config.model_dump(mode="json"),
        tags=tags,
        run_id=latest_state(config, resume_step).get("mlflow_run_id") if resume else None,
        parent_run_id=parent_run_id,
        flush_interval_s=config.tracking.flush_interval_s,
        artifact_location=config.tracking.artifact_location,
    )


@step_task(name="prepare_model")
def prepare_model(config: RunConfig, workdir: Path, tracker: Tracker | None = None) -> Path:
    """The model the run starts from (an image run's pretraining runs here)."""
    if config.diffusion is not None:
        from miles_core.diffusion.runtime import prepare_image_model

        return prepare_image_model(config, workdir, tracker)
    return prepare_model_dir(config, workdir)


@step_task(name="prepare_runtime")
def prepare_runtime(
    config: RunConfig,
    model_dir: Path,
    tracker: Tracker,
    resume: bool = False,
    resume_step: int | None = None,
) -> RLRuntime:
    """Builds engine, trainer and transport from `model_dir`; with `resume`, continues the run's
    latest checkpoint (or checkpoint `resume_step`)."""
    if config.diffusion is not None:
        from miles_core.diffusion.runtime import ImageRuntime

        rt = ImageRuntime(config, model_dir, tracker)
    else:
        rt = RLRuntime(config, model_dir, tracker)
    if resume:
        step = rt.store.latest_step() if resume_step is None else resume_step
        if step is None:
            rt.close()
            raise FileNotFoundError(
                f"--resume: no checkpoint of run {config.name!r} under {config.checkpoint.root}"
            )
        try:
            rt.resume(step)
        except BaseException:
            rt.close()  # the engine server it started must not outlive a refused resume
            raise
    return rt
