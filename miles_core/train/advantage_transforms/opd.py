"""On-policy distillation: Â_t = A_t − coef · (log π_old(y_t) − log π_teacher(y_t)), or, where
the field holds a KL per position itself (the top-k KL, `miles_core/distill/top_k.py`),
Â_t = A_t − coef · kl_t.

The difference is a one-sample estimate of the reverse KL(student ‖ teacher) at the token the
student sampled; a token the teacher likes more than the student gets a higher advantage. π_old
is the student's detached log-prob the PPO ratio divides by, the teacher's comes from the
per-token field the teacher scoring wrote (`miles_core/distill/`). With a teacher equal to the
student the term is exactly 0 and the advantages are the estimator's. Pure distillation pairs it
with the `none` estimator (every A_t = 0)."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from miles_core.plugins import PluginOptions
from miles_core.train.advantage_transform import ADVANTAGE_TRANSFORMS

TEACHER_LOG_PROBS = "teacher_log_probs"


class OpdOptions(PluginOptions):
    coef: float = Field(1.0, gt=0, description="λ: the weight of the KL term")
    field: str = Field(
        TEACHER_LOG_PROBS, description="the per-token field holding the teacher's log-probs"
    )
    holds: Literal["log_probs", "kl"] = Field(
        "log_probs",
        description="log_probs: the field is the teacher's log-prob of each token; kl: the KL "
        "term of each position itself",
    )


@ADVANTAGE_TRANSFORMS.register("opd")
class Opd:
    Options = OpdOptions

    def fields(self, options: OpdOptions) -> list[str]:
        return [options.field]

    def __call__(self, advantages: torch.Tensor, old: torch.Tensor, mb, options: OpdOptions):
        values = mb.padded.fields[options.field].to(old.dtype)
        kl = values if options.holds == "kl" else old - values
        return advantages - options.coef * kl
