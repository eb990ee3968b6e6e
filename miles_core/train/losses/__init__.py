"""Losses outside the backend: token-level pieces (`functional`), the `Loss` protocol (`base`)
and one file per registered loss (`policy`, `sft`; `distill` to come). Look a loss up by name
with `miles_core.train.registry.get_loss`."""

from miles_core.train.losses.functional import (
    aggregate,
    entropy_from_logits,
    k3_kl,
    ppo_clip_loss,
    token_log_probs,
)

__all__ = ["aggregate", "entropy_from_logits", "k3_kl", "ppo_clip_loss", "token_log_probs"]
