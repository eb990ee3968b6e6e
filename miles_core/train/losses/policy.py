"""The RL policy loss: PPO-clip (GRPO advantages) with optional off-policy corrections
(π_old / π_rollout), k3 KL to the reference policy and an entropy bonus."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch
from pydantic import Field, model_validator

from miles_core.plugins import PluginOptions
from miles_core.train.corrections import correction_weights
from miles_core.train.forward import LossNeeds, MicroBatch, TokenOutputs
from miles_core.train.loss import LOSSES
from miles_core.train.loss_terms import aggregate, k3_kl, ppo_clip_loss


class OffPolicyOptions(PluginOptions):
    """`train.loss_options.off_policy`: importance correction for π_old/π_rollout (see
    `miles_core.train.corrections`)."""

    mode: Literal["none", "tis", "icepop", "mis"] = Field(
        "none",
        description="tis truncates the ratio, icepop masks tokens outside [low, high], mis "
        "weights at `level` with truncate or mask",
    )
    low: float = Field(0.0, ge=0, description="lower bound of the ratio band")
    high: float = Field(2.0, gt=0, description="upper bound of the ratio band")
    level: Literal["token", "sequence", "geometric"] = "token"
    mis_mode: Literal["truncate", "mask"] = "truncate"
    veto_threshold: float | None = Field(
        None, gt=0, lt=1, description="mis: reject a sequence holding a token ratio below this"
    )

    @model_validator(mode="after")
    def _band(self) -> OffPolicyOptions:
        if self.low >= self.high:
            raise ValueError(f"low ({self.low}) must be below high ({self.high})")
        return self


class PolicyOptions(PluginOptions):
    """`train.loss_options` of the policy loss."""

    eps_clip: float = Field(0.2, gt=0, lt=1, description="PPO clip range")
    eps_clip_high: float | None = Field(
        None, gt=0, description="upper clip (DAPO clip-higher); default eps_clip"
    )
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "rollout_mean_token_mean"] = Field(
        "token_mean",
        description="token_mean: over all tokens; seq_mean_token_mean: per sample, then over "
        "samples; rollout_mean_token_mean: per rollout (samples sharing a rollout id, e.g. one "
        "agent session's leaves), then over rollouts",
    )
    kl_coef: float = Field(
        0.0, ge=0, description="k3 KL to the initial policy; 0 disables the reference model"
    )
    entropy_coef: float = Field(0.0, ge=0, description="entropy bonus")
    off_policy: OffPolicyOptions = Field(default_factory=OffPolicyOptions)


@LOSSES.register("policy")
class PolicyLoss:
    Options = PolicyOptions

    def config(self, options: Mapping[str, Any] | PolicyOptions) -> PolicyOptions:
        return options if isinstance(options, PolicyOptions) else PolicyOptions(**options)

    def aggregation(self, cfg: PolicyOptions) -> str:
        return cfg.loss_agg

    def needs(self, cfg: PolicyOptions) -> LossNeeds:
        return LossNeeds(entropy="grad" if cfg.entropy_coef else "value", reference=cfg.kl_coef > 0)

    def __call__(
        self, out: TokenOutputs, mb: MicroBatch, cfg: PolicyOptions, denom: float
    ) -> tuple[torch.Tensor, dict[str, float]]:
        batch, lp, agg = mb.batch, out.log_probs, cfg.loss_agg
        mask = mb.mask
        rows = None if batch.rollout_tokens is None else mb.per_row(batch.rollout_tokens)
        # π_old: recomputed, or this forward's own detached (old_is_current: the ratio is 1);
        # the mismatch stats and corrections below compare it with the engine's log-probs
        old = mb.old_log_probs(lp)
        adv = mb.advantages(old)  # per token: the estimator's, then train.advantage_transforms
        eps_high = cfg.eps_clip_high or cfg.eps_clip
        pg, clipped, approx_kl = ppo_clip_loss(lp, old, adv, cfg.eps_clip, eps_high)
        off = cfg.off_policy
        correction = None
        if off.mode != "none":
            if batch.rollout_log_probs is None:
                raise ValueError(
                    "train.loss_options.off_policy needs the engine's log-probs (samples without "
                    "rollout_log_probs)"
                )
            rollout = mb.per_token(batch.rollout_log_probs)
            correction = correction_weights(old, rollout, mask, **off.model_dump())
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
            behaviour = old  # the engine's weights are π_old's, unless a token is stale
            if batch.behaviour_log_probs is not None:  # true on-policy: under its own weights
                stale = mb.per_token(batch.behaviour_log_probs)
                behaviour = torch.where(stale.isnan(), old, stale)
                lag = (old - rollout).abs() * mask
                stats["_policy_lag_logprob_abs_diff"] = float(lag.sum())
            diff = behaviour - rollout
            stats["_train_rollout_logprob_abs_diff"] = float((diff.abs() * mask).sum())
            stats["_train_rollout_kl"] = float((k3_kl(rollout, behaviour) * mask).sum())
        if correction is not None:
            stats.update(correction.stats)
        stats["loss"] = float(total.detach())
        return total, stats
