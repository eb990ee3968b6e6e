"""A saved checkpoint as an MLflow model version of the run (the registry's `source` is its
URI; a LoRA run's adapter directory, tagged with the base model saved beside the checkpoints)."""

from __future__ import annotations

from miles_core.checkpoint.store import BASE_MODEL_DIR
from miles_core.lora.adapter import ADAPTERS_DIR


def register_checkpoint(tracker, config, step: int, version: int, uri: str, sha: str) -> str:
    """Registers checkpoint `uri` as a model version of the run (returns it); a LoRA run's
    adapter is the model version: its peft directory, tagged with the base saved beside."""
    lora = config.train.lora
    if lora is None:
        return tracker.log_policy_version(config.name, step, version, uri, {"weights_sha256": sha})
    base = f"{uri.rsplit('/', 1)[0]}/{BASE_MODEL_DIR}"
    for name in lora.adapters:
        registered = tracker.log_policy_version(
            config.name,
            step,
            version,
            f"{uri}/{ADAPTERS_DIR}/{name}",
            {"weights_sha256": sha, "lora_adapter": name, "base_model": base},
        )
    return registered
