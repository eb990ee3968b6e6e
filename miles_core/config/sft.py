"""The `sft:` section: a supervised warm start before RL."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from miles_core.config.train import OptimConfig
from miles_core.data.tasks import TASKS


class SFTConfig(OptimConfig):
    task: str = "reverse"
    path: str | None = Field(
        None,
        description="JSONL rows with 'prompt' and 'answer'; default: the task's demonstrations",
    )
    num_examples: int = Field(4096, gt=0)
    storage_options: dict[str, Any] = Field(default_factory=dict)
    num_steps: int = Field(200, gt=0)
    batch_size: int = Field(64, gt=0)
    seed: int = 0
    reuse: str | None = Field(
        None,
        description="the HF directory an earlier SFT run of this section saved (its run's "
        "checkpoint, e.g. <checkpoint.root>/<name>-sft/step_<n>): RL starts from it instead "
        "of training it again, e.g. to compare RL seeds after one warm start; its examples "
        "still count as training data (no evaluation task is one of them)",
    )

    @field_validator("task")
    @classmethod
    def _known_task(cls, v: str) -> str:
        TASKS.check(v)
        return v

    @model_validator(mode="after")
    def _divides(self) -> SFTConfig:
        unit = self.micro_batch_size * self.dp_world
        if self.batch_size % unit:
            raise ValueError(
                f"sft.batch_size ({self.batch_size}) must be divisible by micro_batch_size × data-parallel ranks ({unit})"
            )
        return self
