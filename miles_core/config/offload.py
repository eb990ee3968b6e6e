"""`train.offload`: where the optimizer's state lives between steps (`train/optimizer_offload.py`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from miles_core.config.base import Strict


class OffloadSettings(Strict):
    optimizer: Literal["none", "cpu", "disk"] = Field(
        "none",
        description="AdamW's state (fp32 moments and step) between steps: on the trainer's "
        "device (none), in host memory (cpu) or in files (disk), streamed in bucket by bucket "
        "during each step; bitwise the same training either way",
    )
    dir: str | None = Field(
        None,
        description="disk: the directory the bucket files go under (a node-local NVMe); "
        "default: the system's temporary directory. Removed when the trainer exits",
    )
    bucket_mb: float = Field(
        256, gt=0, description="fp32 state streamed per bucket: parameters of this many MB"
    )

    @model_validator(mode="after")
    def _dir_for_disk(self) -> OffloadSettings:
        if self.dir is not None and self.optimizer != "disk":
            raise ValueError(f"offload.dir is for optimizer: disk (this is {self.optimizer!r})")
        return self
