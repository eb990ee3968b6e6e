"""Tasks of the standalone evaluation flow (flows/evaluate.py): registry lookups, scoring a
checkpoint, recording the score."""

from __future__ import annotations

import time
from typing import Any

from mlflow.tracking import MlflowClient

from miles_core.checkpoint.store import local_model_dir
from miles_core.eval.registry import PolicyVersion, mark_version, record_evaluation, resolve
from miles_core.eval.scoring import EvalSpec, score_model_dir
from miles_core.run.tracking import resolve_tracking_uri
from tasks._task import step_task


def _client(tracking_uri: str | None) -> MlflowClient:
    uri = resolve_tracking_uri(tracking_uri)
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


@step_task(name="resolve_policy_version")
def resolve_policy_version(
    model: str, version: str | None, alias: str, tracking_uri: str | None
) -> PolicyVersion:
    """The registered version (given, else the alias's) with its checkpoint and training run."""
    return resolve(_client(tracking_uri), model, version, alias)


@step_task(name="score_checkpoint")
def score_checkpoint(
    target: PolicyVersion,
    prompts: int | None,
    tracking_uri: str | None,
    storage_options: dict[str, Any] | None,
) -> tuple[dict[str, float], str, float]:
    """The checkpoint's eval/* metrics on its training run's fixed eval prompts, the sha256 of
    the weights measured, and the seconds it took."""
    params = _client(tracking_uri).get_run(target.run_id).data.params if target.run_id else {}
    options = storage_options
    if options is None:  # the training run's checkpoint.storage_options
        options = _unflatten(params, "checkpoint.storage_options.")
    t0 = time.perf_counter()
    with local_model_dir(target.source, options or None) as local:
        metrics, sha = score_model_dir(local, EvalSpec.from_params(params, prompts))
    return metrics, sha, time.perf_counter() - t0


@step_task(name="record_score")
def record_score(
    target: PolicyVersion,
    metrics: dict[str, float],
    measured_sha: str,
    seconds: float,
    tracking_uri: str | None,
) -> tuple[str, bool]:
    """A nested run under the training run; the version's score tags and `best-eval`."""
    client = _client(tracking_uri)
    run_id = record_evaluation(client, target, metrics, measured_sha, seconds)
    best = mark_version(client, target.name, target.version, metrics)
    return run_id, best


def _unflatten(params: dict[str, str], prefix: str) -> dict[str, Any]:
    """The nested dict MLflow params flattened under `prefix` (values parsed as YAML)."""
    import yaml

    out: dict[str, Any] = {}
    for key, value in params.items():
        if not key.startswith(prefix):
            continue
        *parents, leaf = key.removeprefix(prefix).split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = yaml.safe_load(value)
    return out
