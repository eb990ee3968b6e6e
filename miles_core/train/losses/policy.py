"""The RL policy loss: PPO-clip (GRPO advantages) with optional off-policy corrections
(π_old / π_rollout), k3 KL to the reference policy and an entropy bonus."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from miles_core.train.corrections import correction_weights
from miles_core.train.forward import LossNeeds, MicroBatch, TokenOutputs
from miles_core.train.loss import LOSSES, pick
from miles_core.train.loss_terms import aggregate, k3_kl, ppo_clip_loss


@dataclass(frozen=True)
class OffPolicySettings:
    """`train.off_policy` (see `miles_core.train.corrections`)."""

    mode: str = "none"
    low: float = 0.0
    high: float = 2.0
    level: str = "token"
    mis_mode: str = "truncate"
    veto_threshold: float | None = None


@dataclass(frozen=True)
class PolicyLossConfig:
    eps_clip: float = 0.2
    eps_clip_high: float | None = None  # default eps_clip
    loss_agg: str = "token_mean"
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    off_policy: OffPolicySettings = field(default_factory=OffPolicySettings)

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> PolicyLossConfig:
        values = pick(cls, settings)
        off = values.get("off_policy")
        if isinstance(off, Mapping):
            values["off_policy"] = OffPolicySettings(**pick(OffPolicySettings, off))
        elif off is not None and not isinstance(off, OffPolicySettings):  # a pydantic section
            values["off_policy"] = OffPolicySettings(**pick(OffPolicySettings, off.model_dump()))
        return cls(**values)


@LOSSES.register("policy")
class PolicyLoss:
    def config(self, settings: Mapping[str, Any]) -> PolicyLossConfig:
        return PolicyLossConfig.from_settings(settings)

    def aggregation(self, cfg: PolicyLossConfig) -> str:
        return cfg.loss_agg

    def needs(self, cfg: PolicyLossConfig) -> LossNeeds:
        return LossNeeds(entropy="grad" if cfg.entropy_coef else "value", reference=cfg.kl_coef > 0)

    def __call__(
        self, out: TokenOutputs, mb: MicroBatch, cfg: PolicyLossConfig, denom: float
    ) -> tuple[torch.Tensor, dict[str, float]]:
        batch, lp, agg = mb.batch, out.log_probs, cfg.loss_agg
        if batch.advantages is None:
            raise ValueError("policy loss needs advantages")
        mask = mb.mask
        rows = None if batch.rollout_tokens is None else mb.per_row(batch.rollout_tokens)
        # π_old: recomputed, or this forward's own detached (old_is_current: the ratio is 1);
        # the mismatch stats and corrections below compare it with the engine's log-probs
        old = mb.old_log_probs(lp)
        adv = mb.per_row(batch.advantages).unsqueeze(1).expand_as(mask)
        eps_high = cfg.eps_clip_high or cfg.eps_clip
        pg, clipped, approx_kl = ppo_clip_loss(lp, old, adv, cfg.eps_clip, eps_high)
        off = cfg.off_policy
        correction = None
        if off.mode != "none":
            if batch.rollout_log_probs is None:
                raise ValueError(
                    "train.off_policy needs the engine's log-probs (samples without "
                    "rollout_log_probs)"
                )
            rollout = mb.per_token(batch.rollout_log_probs)
            correction = correction_weights(old, rollout, mask, **asdict(off))
            pg = pg * correction.weights  # the numerator only: `denom` keeps every token
        pg_loss = aggregate(pg, mask, agg, denom, rows)
        total = pg_loss
        entropy = out.entropy
        assert entropy is not None, "the backend ignored LossNeeds.entropy"
        if cfg.entropy_coef:
            total = total - cfg.entropy_coef * aggregate(entropy, mask, agg, denom, rows)
        stats = {
            "pg_loss": float(pg_loss.detach()),
            "_pg_clipfrac": float((clipped * mask).sum()),
            "_ppo_kl": float((approx_kl.detach() * mask).sum()),
            "_entropy": float((entropy.detach() * mask).sum()),
        }
        if cfg.kl_coef > 0:
            assert out.ref_log_probs is not None, "the backend ignored LossNeeds.reference"
            kl = k3_kl(lp, out.ref_log_probs)
            kl_loss = aggregate(kl, mask, agg, denom, rows)
            total = total + cfg.kl_coef * kl_loss
            stats["kl_loss"] = float(kl_loss.detach())
        if batch.rollout_log_probs is not None:
            rollout = mb.per_token(batch.rollout_log_probs)
            diff = old - rollout
            stats["_train_rollout_logprob_abs_diff"] = float((diff.abs() * mask).sum())
            stats["_train_rollout_kl"] = float((k3_kl(rollout, old) * mask).sum())
        if correction is not None:
            stats.update(correction.stats)
        stats["loss"] = float(total.detach())
        return total, stats
