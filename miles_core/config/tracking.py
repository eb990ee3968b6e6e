"""The `tracking:` section: the MLflow experiment and run."""

from __future__ import annotations

from pydantic import Field

from miles_core.config.base import Strict


class TrackingConfig(Strict):
    experiment: str = "miles"
    tracking_uri: str | None = Field(
        None, description="default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db"
    )
    artifact_location: str | None = Field(
        None,
        description="where a new experiment keeps its runs' artifacts (a folder or a URI, e.g. "
        "s3://bucket/mlruns; one sub-folder per experiment); default: beside a SQLite store "
        "(<db folder>/mlruns/<experiment>), else the tracking server's default",
    )
    run_name: str | None = None
    register_policy: bool = Field(
        True, description="record each checkpoint as a registered model version"
    )
    flush_interval_s: float = Field(
        5.0,
        ge=0,
        description="at most one metrics write per this many seconds (on the step loop's "
        "thread; a step longer than this writes at once); 0 writes every step",
    )
