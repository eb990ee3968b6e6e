"""The `model:` section: the architecture preset or HF directory a run starts from."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from miles_core.config.base import Strict


class ModelConfig(Strict):
    preset: Literal["tiny", "small", "medium", "tiny-moe", "small-moe", "tiny-moe-shared"] = Field(
        "tiny",
        description="architecture preset for a random init: dense Qwen3 (tiny, small, medium) "
        "or mixture of experts (tiny-moe, small-moe: Qwen3-MoE; tiny-moe-shared: GLM4-MoE "
        "with a shared expert)",
    )
    path: str | None = Field(
        None,
        description="HF directory to start from instead of a random init (local path, or an fsspec "
        "URL read with checkpoint.storage_options)",
    )
    seed: int = Field(0, description="seed of the random init")
    context: int | None = Field(
        None,
        gt=0,
        le=32768,
        description="a preset's context (max_position_embeddings; default 512), e.g. for long "
        "agent episodes; a model.path model keeps its own",
    )

    @model_validator(mode="after")
    def _context_for_presets(self) -> ModelConfig:
        if self.context is not None and self.path is not None:
            raise ValueError(
                "model.context sets a preset's context; the model at model.path keeps its own "
                "(max_position_embeddings in its config.json): leave model.context unset"
            )
        return self
