"""Standalone evaluation flow: scores a registered policy version and records the result as a
nested MLflow run of the training run that produced it.

    resolve the version (given, else the alias: newest) → [skip if already scored]
    → score its checkpoint on the run's fixed eval prompts → nested run + version tags + best-eval

Scheduled by `deployments/` (an interval or cron deployment of this flow scores each new
version as it is registered); also `miles evaluate --model say-a [--version 3]`.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from tasks.evaluate_version import record_score, resolve_policy_version, score_checkpoint


@flow(name="evaluate-policy", log_prints=True)
def evaluate(
    model: str,
    version: str | None = None,
    alias: str = "newest",
    tracking_uri: str | None = None,
    prompts: int | None = None,  # default: the training run's eval.prompts
    skip_evaluated: bool = True,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    try:
        target = resolve_policy_version(model, version, alias, tracking_uri)
    except LookupError as e:
        if version is not None:  # an explicit version that is not there is the caller's error
            raise
        print(f"nothing to evaluate yet: {e}")  # e.g. a schedule firing before the first save
        return {"skipped": True, "model": model, "reason": str(e)}
    if skip_evaluated and target.evaluated:
        print(f"{model} version {target.version} is scored already; nothing to do")
        return {"skipped": True, "model": model, "version": target.version}
    metrics, measured_sha, seconds = score_checkpoint(
        target, prompts, tracking_uri, storage_options
    )
    eval_run_id, best = record_score(target, metrics, measured_sha, seconds, tracking_uri)
    print(
        f"{model} version {target.version} (policy version {target.policy_version}): "
        f"reward {metrics['eval/reward_mean']:.4f}{' (best so far)' if best else ''}"
    )
    return {
        "skipped": False,
        "model": model,
        "version": target.version,
        "policy_version": target.policy_version,
        "eval_run_id": eval_run_id,
        "best": best,
        "weights_match": measured_sha == target.weights_sha256,
        **metrics,
    }
