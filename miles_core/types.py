"""The records that flow through the loop: Sample, its Status, and groups of samples."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np

from miles_core.token_fields import check_lengths, fields_from_json, fields_to_json


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
    metadata: dict[str, Any] = field(default_factory=dict)
    # declared per-token fields (miles_core/token_fields.py): name -> array [rows, *shape]
    # (routed experts, teacher log-probs, ... each a TokenField)
    token_fields: dict[str, np.ndarray] = field(default_factory=dict)

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
        try:
            check_lengths(self.token_fields, len(self.tokens), n)
        except (ValueError, KeyError) as e:
            raise ValueError(f"sample {self.index}: {e}") from None
        if any(m not in (0, 1) for m in self.loss_mask):
            raise ValueError(f"sample {self.index}: loss_mask must hold only 0 and 1")
        if self.status in (Status.COMPLETED, Status.TRUNCATED) and self.reward is None:
            raise ValueError(f"sample {self.index}: status {self.status.value} but no reward")


def sample_to_json(sample: Sample, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """A Sample as JSON values (token fields as exact bytes); `skip` leaves fields out."""
    data = {
        f.name: getattr(sample, f.name) for f in dataclasses.fields(sample) if f.name not in skip
    }
    data["status"] = sample.status.value
    if "token_fields" in data:
        data["token_fields"] = fields_to_json(sample.token_fields)
    return data


def sample_from_json(data: dict[str, Any], **override: Any) -> Sample:
    """The Sample `sample_to_json` wrote (fields it skipped come from `override`)."""
    fields = dict(data, **override)
    unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(Sample)})
    if unknown:  # e.g. a per-token array of an older build, now a declared token field
        raise ValueError(f"sample {fields.get('index')}: unknown keys {', '.join(unknown)}")
    fields["status"] = Status(fields["status"])
    fields["token_fields"] = fields_from_json(fields.get("token_fields"))
    return Sample(**fields)


@dataclass
class SampleGroup:
    """The n samples drawn for one prompt (the GRPO group)."""

    group_index: int
    samples: list[Sample]

    @property
    def rewards(self) -> list[float]:
        return [float(s.reward or 0.0) for s in self.samples]
