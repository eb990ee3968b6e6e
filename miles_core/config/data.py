"""The `data:` section: the task and its prompts."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from miles_core.config.base import Strict
from miles_core.data.tasks import TASKS


class DataConfig(Strict):
    task: str = Field(
        "say_a", description="built-in task (say_a, reverse, add) or 'package.module:object'"
    )
    path: str | None = Field(
        None, description="JSONL prompts (local path or fsspec URL); default: the task's generator"
    )
    num_prompts: int = Field(2048, gt=0, description="prompts to generate when no path is given")
    seed: int = 0
    shuffle: bool = True
    storage_options: dict[str, Any] = Field(default_factory=dict)
    exclude_sft: bool = Field(
        False,
        description="RL prompts that are none of the sft: warm start's examples (RL then works on "
        "tasks the SFT never showed, as the held-out evaluation does); a generator draws more "
        "to keep num_prompts, a data.path file's matching rows are left out",
    )

    @field_validator("task")
    @classmethod
    def _known_task(cls, v: str) -> str:
        TASKS.check(v)  # raises ValueError with the list of known tasks
        return v
