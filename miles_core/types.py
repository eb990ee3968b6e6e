"""The records that flow through the loop: Sample, its Status, and groups of samples."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class Status(StrEnum):
    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


FINISH_REASON_TO_STATUS = {
    "stop": Status.COMPLETED,
    "length": Status.TRUNCATED,
    "abort": Status.ABORTED,
}


@dataclass
class Sample:
    """One trajectory: prompt + response token ids exactly as the engine produced them."""

    group_index: int
    index: int
    rollout_id: str
    prompt: str | list[dict[str, Any]]
    tokens: list[int]
    response_length: int
    loss_mask: list[int]
    rollout_log_probs: list[float]
    weight_versions: list[int] = field(default_factory=list)
    reward: float | None = None
    status: Status = Status.PENDING
    label: Any = None
    response: str = ""
    routed_experts: Any = None
    teacher_log_probs: list[float] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    @property
    def response_tokens(self) -> list[int]:
        return self.tokens[self.prompt_length :]

    @property
    def oldest_weight_version(self) -> int | None:
        return min(self.weight_versions) if self.weight_versions else None

    def validate(self) -> None:
        """Raises ValueError naming the first broken length invariant."""
        n = self.response_length
        if n < 0 or n >= len(self.tokens):
            raise ValueError(
                f"sample {self.index}: response_length {n} outside 0..{len(self.tokens) - 1} "
                "(the prompt needs at least one token)"
            )
        if len(self.loss_mask) != n:
            raise ValueError(
                f"sample {self.index}: loss_mask has {len(self.loss_mask)} entries, response_length is {n}"
            )
        if len(self.rollout_log_probs) != n:
            raise ValueError(
                f"sample {self.index}: rollout_log_probs has {len(self.rollout_log_probs)} entries, response_length is {n}"
            )
        if self.teacher_log_probs is not None and len(self.teacher_log_probs) != n:
            raise ValueError(
                f"sample {self.index}: teacher_log_probs length {len(self.teacher_log_probs)} != {n}"
            )
        if any(m not in (0, 1) for m in self.loss_mask):
            raise ValueError(f"sample {self.index}: loss_mask must hold only 0 and 1")
        if self.status in (Status.COMPLETED, Status.TRUNCATED) and self.reward is None:
            raise ValueError(f"sample {self.index}: status {self.status.value} but no reward")


@dataclass
class SampleGroup:
    """The n samples drawn for one prompt (the GRPO group)."""

    group_index: int
    samples: list[Sample]

    @property
    def rewards(self) -> list[float]:
        return [float(s.reward or 0.0) for s in self.samples]
