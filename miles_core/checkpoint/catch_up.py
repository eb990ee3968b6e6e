"""Tracking catch-up on resume: a process killed just after writing checkpoint `step` may not
have flushed that step's metrics to MLflow, nor registered the checkpoint as a policy version;
the resuming process does both (once: what MLflow already holds is left alone)."""

from __future__ import annotations

import logging

from miles_core.checkpoint.registration import register_checkpoint

log = logging.getLogger("miles")


def record_what_the_dead_process_missed(tracker, config, step: int, state: dict, uri: str) -> None:
    """`state`: checkpoint `step`'s state.json (its `step_metrics`, versions, checksums)."""
    t = tracker
    metrics = state.get("step_metrics") or {}
    if t is None:
        return
    key = next((k for k in ("rollout/reward_mean", *metrics) if k in metrics), None)
    if key is not None:
        logged = {m.step for m in t.client.get_metric_history(t.run_id, key)}
        if step not in logged:
            log.warning("step %d's metrics were never logged: logging them now", step)
            t.log_metrics(metrics, step)
            t.flush()
    if config.tracking.register_policy and state.get("weights_sha256"):
        found = t.client.search_model_versions(f"name='{config.name}' and run_id='{t.run_id}'")
        if not any(mv.tags.get("step") == str(step) for mv in found):
            log.warning("checkpoint %s was never registered: registering it now", uri)
            sha = state.get("saved_weights_sha256", state["weights_sha256"])
            register_checkpoint(t, config, step, int(state["policy_version"]), uri, sha)
            t.set_tags({"miles.last_checkpoint": uri})
