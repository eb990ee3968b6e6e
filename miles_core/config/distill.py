"""The `train.distill:` section: on-policy distillation from teacher models (miles_core/distill/).

Each teacher runs as an engine: a model directory is served by an engine server the run starts
(and stops), a URL is any server speaking SGLang's `/generate` that the run attaches to. The
teachers score the student's own sampled token ids; the per-token difference of log-probs joins
the advantage (`opd` advantage transform, Â = A − coef · (log π_student − log π_teacher)); with
kd_top_k, the teacher's k likeliest tokens at each position add a dense term to the loss (the
`distill` loss)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from miles_core.config.base import Strict

DEFAULT_TEACHER = "default"
TEACHER_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def is_url(source: str) -> bool:
    return source.startswith(("http://", "https://"))


class DistillSettings(Strict):
    teachers: dict[str, str] = Field(
        description="name → a model directory (served by an engine server the run starts) or "
        "the http(s) URL of a running SGLang-protocol server; a sample is scored by the teacher "
        "its data row names in `teacher_key`, else by the one named 'default'",
    )
    coef: float = Field(
        1.0,
        ge=0,
        description="λ in Â = A − λ · (log π_student − log π_teacher); 0 leaves the advantage "
        "alone (a run with kd_top_k only)",
    )
    teacher_key: str = Field(
        "teacher", description="the data row field naming a sample's teacher (JSONL rows)"
    )
    temperature: float | None = Field(
        None,
        gt=0,
        description="the temperature teachers score at; default and only accepted value: "
        "rollout.temperature (both sides of the KL at the same temperature)",
    )
    top_k: int = Field(
        0,
        ge=0,
        description="0: the sampled token's log-prob difference; k > 0: the KL over each "
        "position's top-k token set, the student's probabilities renormalised over it",
    )
    top_k_strategy: Literal["only_student", "only_teacher", "intersection", "union"] = Field(
        "only_teacher", description="which top-k set the KL sums over (with top_k > 0)"
    )

    kd_top_k: int = Field(
        0,
        ge=0,
        description="k > 0: add a dense term to the loss, at each position the student sampled "
        "the KL from the teacher's distribution over its k likeliest tokens (renormalised) to "
        "the student's: a gradient through the student's log-probs of those k tokens "
        "(train.loss policy, which becomes `distill`)",
    )
    kd_coef: float = Field(1.0, gt=0, description="the weight of the kd_top_k term")

    @model_validator(mode="after")
    def _some_signal(self) -> DistillSettings:
        if self.coef == 0 and not self.kd_top_k:
            raise ValueError(
                "coef 0 with kd_top_k 0 leaves nothing of the teacher in training: set coef > 0 "
                "(the advantage term), kd_top_k > 0 (the dense term), or both"
            )
        if self.coef == 0 and self.top_k:
            raise ValueError(
                "top_k sets the advantage term's KL, which coef 0 turns off: leave top_k at 0 "
                "(kd_top_k sets the dense term's tokens)"
            )
        return self

    @field_validator("teachers")
    @classmethod
    def _teachers(cls, teachers: dict[str, str]) -> dict[str, str]:
        if not teachers:
            raise ValueError("name at least one teacher (e.g. teachers: {default: path/to/model})")
        for name, source in teachers.items():
            if not TEACHER_NAME.fullmatch(name):
                raise ValueError(
                    f"teacher name {name!r}: letters, digits, '_' and '-' only (1-64 characters)"
                )
            if not source.strip():
                raise ValueError(f"teacher {name!r}: give a model directory or an http(s) URL")
        return teachers

    def add_to(self, run) -> None:
        """Into a run's config (a RunConfig): the teachers' log-probs as token fields, the `opd`
        transform (coef) after the estimator, and with kd_top_k the `distill` loss in place of
        `policy`; the teachers score at the student's temperature."""
        from miles_core.distill import field
        from miles_core.train.advantage_transform import ADVANTAGE_TRANSFORMS
        from miles_core.train.loss import LOSSES

        r, t = run.rollout, run.train
        if self.temperature is not None and self.temperature != r.temperature:
            raise ValueError(
                f"train.distill.temperature ({self.temperature:g}) must equal "
                f"rollout.temperature ({r.temperature:g}): the KL compares the student's and the "
                "teacher's log-probs, both at the temperature the student samples at"
            )
        if self.top_k and t.lora is not None:
            raise ValueError(
                "train.distill.top_k with train.lora: the student's side of a top-k KL is scored "
                "by its engine, and scoring with an adapter is not built; use top_k 0 (kd_top_k "
                "works with LoRA)"
            )
        paths = [field.PATH] + ([field.TOP_K_PATH] if self.top_k else [])
        paths += list(field.kd_paths(self.kd_top_k)) if self.kd_top_k else []
        r.token_fields += [p for p in paths if p not in r.token_fields]
        if self.coef and "opd" not in t.advantage_transforms:
            # top-k: the field holds each position's KL itself (distill/top_k.py)
            kl = {"field": field.TOP_K_KL.name, "holds": "kl"} if self.top_k else {}
            t.advantage_transforms["opd"] = ADVANTAGE_TRANSFORMS.options(
                "opd", {"coef": self.coef} | kl
            )
        if not self.kd_top_k:
            return
        if t.loss == "policy":
            dense = {"kd_top_k": self.kd_top_k, "kd_coef": self.kd_coef}
            t.loss_options = LOSSES.options("distill", t.loss_options.model_dump() | dense)
            t.loss = "distill"
        elif t.loss != "distill" or t.loss_options.kd_top_k != self.kd_top_k:
            raise ValueError(
                f"train.distill.kd_top_k adds its term to the policy loss (train.loss becomes "
                f"distill); train.loss is {t.loss}: leave it at policy, or kd_top_k at 0"
            )
