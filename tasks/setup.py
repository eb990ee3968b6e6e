from __future__ import annotations

from pathlib import Path

from prefect.runtime import flow_run

from miles_core.config import RunConfig
from miles_core.runtime import RLRuntime, prepare_model_dir
from miles_core.tracking import Tracker
from tasks._task import step_task


@step_task(name="start_tracking")
def start_tracking(config: RunConfig, run_name: str, parent_run_id: str | None = None) -> Tracker:
    """One MLflow run per training run; params are the flattened config."""
    tags = {"prefect.flow_run_id": str(flow_run.id or ""), "miles.policy_version": "0"}
    return Tracker(
        config.tracking.tracking_uri,
        config.tracking.experiment,
        run_name,
        params=config.model_dump(mode="json"),
        tags=tags,
        parent_run_id=parent_run_id,
    )


@step_task(name="prepare_model")
def prepare_model(config: RunConfig, workdir: Path) -> Path:
    return prepare_model_dir(config, workdir)


@step_task(name="prepare_runtime")
def prepare_runtime(
    config: RunConfig, model_dir: Path, tracker: Tracker, resume: bool = False
) -> RLRuntime:
    """Builds engine, trainer and transport from `model_dir`; with `resume`, continues the run's latest checkpoint."""
    rt = RLRuntime(config, model_dir, tracker)
    if resume:
        latest = rt.store.latest_step()
        if latest is None:
            raise FileNotFoundError(
                f"--resume: no checkpoint of run {config.name!r} under {config.checkpoint.root}"
            )
        rt.resume(latest)
    return rt
