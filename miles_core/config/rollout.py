"""The `rollout:` section: the engine, the rollout mode and sampling."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from miles_core.config.base import (
    PluginOptionsField,
    Strict,
    in_trainer_process,
    options_field,
    plugin_validators,
)
from miles_core.engines.registry import ENGINES
from miles_core.rollout.mode import MODES


def _formats():
    from miles_core.precision.format import FORMATS  # imports torch: when validating

    return FORMATS


class RolloutConfig(Strict):
    engine: str = Field(
        "embedded",
        description="an engine in miles_core/engines/kinds/ or 'package.module:Kind'. "
        "embedded: batched sampler on the HF modules; serving: continuous batching with prefix "
        "reuse (GRPO siblings share the prompt's KV), per-request seeds; server: the serving "
        "engine as subprocesses on 127.0.0.1 behind SGLang's HTTP API (weights travel by "
        "weight_sync.transport shared_memory, disk, broadcast or p2p)",
    )
    engine_options: PluginOptionsField = options_field("engine")
    adapter: str | None = Field(
        None,
        description="the LoRA adapter every rollout request names (lora_path); default with "
        "train.lora: its adapter",
    )
    mode: str = Field(
        "sync",
        description="a module of miles_core/rollout/modes/ or 'package.module:Mode'. sync: "
        "generate, then train; one_step_off: the next batch is generated while the trainer "
        "trains (weights pushed between batches); fully_async: a producer keeps the engine "
        "busy, weights pushed any time (both need an engine server)",
    )
    mode_options: PluginOptionsField = options_field("mode")
    pause_mode: Literal["abort", "retract", "in_place"] = Field(
        "retract", description="how a weight push pauses generation on the engine"
    )
    prompts_per_step: int = Field(
        16, gt=0, description="prompts sampled per rollout (rollout batch size)"
    )
    n_samples_per_prompt: int = Field(8, gt=0, description="GRPO group size")
    max_new_tokens: int = Field(16, gt=0)
    temperature: float = Field(1.0, gt=0)
    reward_timeout_s: float = Field(
        30.0,
        gt=0,
        description="a reward function (task.score) running longer fails its sample (reward 0, "
        "nothing trained)",
    )
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, description="-1 disables top-k")
    seed: int = 0
    token_fields: list[str] = Field(
        default_factory=list,
        description="declared per-token fields the samples carry to the trainer (import paths "
        "pkg.mod:FIELD of miles_core.token_fields.TokenField objects); the engine is asked for "
        "those with a request flag. train.routing_replay and train.check_routing_replay add "
        "the MoE routes field (miles_core.models.moe:ROUTES)",
    )

    precision: str = Field(
        "none",
        description="a format in miles_core/precision/formats/ the engine serves the linear "
        "weights in: none | fp8 | fp8_block | mxfp8 | mxfp4 | nvfp4 | int4; pushes carry the "
        "quantized tensors (what is kept unquantized: precision.keep_bf16)",
    )
    precision_options: PluginOptionsField = options_field("precision")

    _engine, _engine_options = plugin_validators("engine", lambda: ENGINES)
    _precision, _precision_options = plugin_validators("precision", _formats)
    _mode, _mode_options = plugin_validators("mode", lambda: MODES)

    @field_validator("token_fields")
    @classmethod
    def _token_fields_load(cls, paths: list[str]) -> list[str]:
        from miles_core.token_fields import load_token_fields

        load_token_fields(paths)  # imports and declares them: a clear error before anything runs
        return paths

    @model_validator(mode="after")
    def _async_needs_a_server(self) -> RolloutConfig:
        if MODES.get(self.mode).ahead and in_trainer_process(self.engine):
            raise ValueError(f"rollout.mode {self.mode} needs rollout.engine: server")
        return self
