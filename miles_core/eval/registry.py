"""The registry side of evaluation: which checkpoint a registered policy version is, a nested
MLflow run per standalone evaluation, and the `best-eval` alias.

Scores are logged at step = the version's policy version (the training steps behind it), the
step at which the training run logs its own `eval/*` points."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from mlflow.entities import Metric
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from miles_core.run.tracking import NEWEST_POLICY_ALIAS

BEST_EVAL_ALIAS = "best-eval"
SCORE_KEY = "eval/reward_mean"  # what `best-eval` ranks by (higher is better)
EVALUATED_TAG = "eval.reward_mean"  # set on a model version once it has a score


@dataclass(frozen=True)
class PolicyVersion:
    name: str
    version: str  # the registered model version
    source: str  # the checkpoint URI
    run_id: str | None  # the training run
    step: int  # the checkpoint's training step (0-based)
    policy_version: int
    weights_sha256: str | None
    tags: dict[str, str]

    @property
    def evaluated(self) -> bool:
        return EVALUATED_TAG in self.tags


def resolve(
    client: MlflowClient, name: str, version: str | None = None, alias: str = NEWEST_POLICY_ALIAS
) -> PolicyVersion:
    """The registered version `version` of `name`, else the one `alias` points at."""
    try:
        mv = (
            client.get_model_version(name, str(version))
            if version is not None
            else client.get_model_version_by_alias(name, alias)
        )
    except MlflowException as e:
        what = f"version {version}" if version is not None else f"alias {alias!r}"
        raise LookupError(f"registered policy {name!r} has no {what}: {e.message}") from e
    tags = dict(mv.tags or {})
    return PolicyVersion(
        name=name,
        version=str(mv.version),
        source=mv.source,
        run_id=mv.run_id,
        step=int(tags.get("step", -1)),
        policy_version=int(tags.get("policy_version", 0)),
        weights_sha256=tags.get("weights_sha256"),
        tags=tags,
    )


def mark_version(client: MlflowClient, name: str, version: str, metrics: dict[str, float]) -> bool:
    """Tags the model version with its scores; moves `best-eval` to it when its score beats
    the current best's. Returns whether it is now the best."""
    for key, value in metrics.items():
        if key.startswith("eval/") and math.isfinite(value):
            client.set_model_version_tag(name, version, key.replace("/", "."), str(value))
    score = metrics.get(SCORE_KEY)
    if score is None or not math.isfinite(score):
        return False
    try:
        best = client.get_model_version_by_alias(name, BEST_EVAL_ALIAS)
        best_score = float((best.tags or {}).get(EVALUATED_TAG, "-inf"))
    except MlflowException:  # no best yet
        best, best_score = None, -math.inf
    if best is not None and str(best.version) != str(version) and score <= best_score:
        return False
    client.set_registered_model_alias(name, BEST_EVAL_ALIAS, str(version))
    return True


def record_evaluation(
    client: MlflowClient,
    target: PolicyVersion,
    metrics: dict[str, float],
    measured_sha256: str | None,
    seconds: float,
) -> str:
    """A nested run under the training run holding one evaluation of `target`; returns its id."""
    experiment = client.get_run(target.run_id).info.experiment_id if target.run_id else "0"
    tags = {
        "mlflow.runName": f"eval-{target.name}-v{target.version}",
        "miles.kind": "evaluation",
        "miles.model_name": target.name,
        "miles.model_version": target.version,
        "miles.policy_version": str(target.policy_version),
        "miles.checkpoint": target.source,
        "miles.weights_sha256": str(measured_sha256),
        "miles.weights_match": str(measured_sha256 == target.weights_sha256),
    }
    if target.run_id:
        tags["mlflow.parentRunId"] = target.run_id
    run = client.create_run(experiment, tags=tags, run_name=tags["mlflow.runName"])
    now = int(time.time() * 1000)
    points = [
        Metric(k, float(v), now, target.policy_version)
        for k, v in (metrics | {"eval/time_s": seconds}).items()
        if math.isfinite(float(v))
    ]
    client.log_batch(run.info.run_id, metrics=points)
    client.set_terminated(run.info.run_id, "FINISHED")
    return run.info.run_id
