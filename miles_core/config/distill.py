"""The `train.distill:` section: on-policy distillation from teacher models (miles_core/distill/).

Each teacher runs as an engine: a model directory is served by an engine server the run starts
(and stops), a URL is any server speaking SGLang's `/generate` that the run attaches to. The
teachers score the student's own sampled token ids; the per-token difference of log-probs joins
the advantage (`opd` advantage transform, Â = A − coef · (log π_student − log π_teacher))."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

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
    coef: float = Field(1.0, gt=0, description="λ in Â = A − λ · (log π_student − log π_teacher)")
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
