"""The loss protocol: a function of a backend's `TokenOutputs` and a typed config.

A loss is a class in `train/losses/` registering itself (`@LOSSES.register(name)`) or one given
by import path; `LOSSES.get(name)` is an instance (a class is built without arguments).
`train_step(batch, loss=name)` resolves it on every rank, so follower ranks run the same code.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch

from miles_core.plugins import Registry
from miles_core.train.forward import LossNeeds, MicroBatch, TokenOutputs


class Loss(Protocol):
    Options: type  # its settings (train.loss_options), a PluginOptions model

    def config(self, options: Mapping[str, Any]) -> Any:
        """Its typed settings from `options` (train.loss_options when the run's loss is this
        one, else {}): unknown keys are refused, missing ones take defaults."""
        ...

    def aggregation(self, cfg: Any) -> str:
        """How the step loop sizes the global denominator: token_mean (tokens of the global
        batch), seq_mean_token_mean (sequences) or rollout_mean_token_mean (rollouts)."""
        ...

    def needs(self, cfg: Any) -> LossNeeds:
        """What the backend's forward must return besides log-probs."""
        ...

    def __call__(
        self, out: TokenOutputs, mb: MicroBatch, cfg: Any, denom: float
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """(this micro-batch's loss, already divided by the global `denom`; its stats). A stat
        named `_x` is a token sum, reported as `x` divided by the global token count; any other
        stat is summed over micro-batches and ranks as it is.

        The old policy's log-probs come from `mb.old_log_probs(out.log_probs)`, never from
        `mb.batch.old_log_probs` directly: with one optimizer step per rollout the batch is
        `old_is_current` (no recompute ran, `old_log_probs` is None) and π_old is this forward's
        log-probs, detached."""
        ...


def loss_options(settings: Mapping[str, Any] | None, name: str) -> Mapping[str, Any]:
    """The options `settings` (a trainer's loss settings: the train section as a mapping) hold
    for loss `name`: `loss_options` when `name` is the section's loss, else none."""
    if not settings or settings.get("loss", "policy") != name:
        return {}
    return settings.get("loss_options") or {}


def _loss(obj: Any, name: str) -> Any:
    """A registered or imported loss as an instance (a class is built without arguments)."""
    loss = obj() if isinstance(obj, type) else obj
    missing = [
        m for m in ("config", "aggregation", "needs") if not callable(getattr(loss, m, None))
    ]
    if missing or not callable(loss):
        raise ValueError(
            f"loss {name!r} is not a loss: it needs config(settings), aggregation(cfg), "
            "needs(cfg) and __call__(out, micro_batch, cfg, denom)"
        )
    return loss


LOSSES: Registry[Any] = Registry(
    "loss", "train.loss", package="miles_core.train.losses", load=_loss
)
