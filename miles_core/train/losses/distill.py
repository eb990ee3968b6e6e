"""The policy loss with on-policy distillation's dense term (train.distill.kd_top_k):

    kd_t = Σ_{i ∈ top-k of the teacher} w_i · (log w_i − log π_θ(i)),
    w = the teacher's probabilities of its k likeliest tokens, renormalised over them

at each response position the student sampled. kd_t is the KL from the teacher's distribution
over its k likeliest tokens to the student's; its gradient moves the student's log-probs of
those k tokens toward the teacher's weights (a cross-entropy with the teacher's soft labels at
the student's own positions), where the advantage term moves only the sampled token's. It is
≥ 0, and 0 only where the student puts all its mass on the set in the teacher's proportions.

The ids and their teacher log-probs are two per-token fields the teacher scoring writes
(`miles_core/distill/field.py`); the forward gathers the student's log-probs of the ids
(`LossNeeds.gather`). The policy loss is computed as it is (with the `opd` transform's
sampled-token term in the advantages where train.distill.coef > 0), and kd_coef · kd joins it
under the same aggregation."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
from pydantic import Field

from miles_core.distill.field import kd_names
from miles_core.train.forward import LossNeeds, MicroBatch, TokenOutputs
from miles_core.train.loss import LOSSES
from miles_core.train.loss_terms import aggregate
from miles_core.train.losses.policy import PolicyLoss, PolicyOptions


class DistillOptions(PolicyOptions):
    """`train.loss_options` of the distill loss: the policy loss's, and the dense term's."""

    kd_top_k: int = Field(ge=1, description="k: the teacher's likeliest tokens per position")
    kd_coef: float = Field(1.0, gt=0, description="the weight of the dense term")


def kd_term(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """kd_t per position [B, R] from the student's and the teacher's log-probs of the teacher's
    top-k tokens, both [B, R, k]."""
    log_w = torch.log_softmax(teacher.to(student.dtype), dim=-1)
    return (log_w.exp() * (log_w - student)).sum(-1)


@LOSSES.register("distill")
class DistillLoss(PolicyLoss):
    Options = DistillOptions

    def config(self, options: Mapping[str, Any] | DistillOptions) -> DistillOptions:
        return options if isinstance(options, DistillOptions) else DistillOptions(**options)

    def needs(self, cfg: DistillOptions) -> LossNeeds:
        return replace(super().needs(cfg), gather=kd_names(cfg.kd_top_k)[0])

    def __call__(
        self, out: TokenOutputs, mb: MicroBatch, cfg: DistillOptions, denom: float
    ) -> tuple[torch.Tensor, dict[str, float]]:
        total, stats = super().__call__(out, mb, cfg, denom)
        assert out.gathered is not None, "the backend ignored LossNeeds.gather"
        teacher = mb.padded.fields[kd_names(cfg.kd_top_k)[1]]
        batch = mb.batch
        rows = None if batch.rollout_tokens is None else mb.per_row(batch.rollout_tokens)
        kd = kd_term(out.gathered, teacher)
        kd_loss = aggregate(kd, mb.mask, cfg.loss_agg, denom, rows)
        total = total + cfg.kd_coef * kd_loss
        stats["kd_loss"] = float(kd_loss.detach())
        stats["loss"] = float(total.detach())
        return total, stats
