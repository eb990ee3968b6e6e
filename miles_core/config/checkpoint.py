"""The `checkpoint:` section: where and how often a run saves."""

from __future__ import annotations

import os
from typing import Any

from pydantic import Field

from miles_core.config.base import Strict


class CheckpointConfig(Strict):
    root: str = Field(
        default_factory=lambda: os.environ.get("MILES_CHECKPOINT_ROOT", "checkpoints"),
        description="fsspec root: a local path or s3://bucket/prefix (default: "
        "$MILES_CHECKPOINT_ROOT, else ./checkpoints)",
    )
    interval: int = Field(0, ge=0, description="save every N steps; 0 saves only at the end")
    storage_options: dict[str, Any] = Field(default_factory=dict)
    overwrite: bool = Field(
        False,
        description="a new run (not --resume) whose name already has checkpoints under root "
        "replaces them; false: such a run is refused before anything starts",
    )
