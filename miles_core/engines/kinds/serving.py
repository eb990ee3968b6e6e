"""`serving`: our continuous-batching engine (prefix reuse, per-request seeds) in the trainer's
process, stepped by the caller; its options are the serving engine's compute settings, which the
`server` engine shares."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from miles_core.engines.protocol import IN_PROCESS_ROUTES
from miles_core.engines.registry import ENGINES, BuiltEngine, EngineKind, EngineSetup
from miles_core.models.moe import ROUTES
from miles_core.plugins import PluginOptions
from miles_core.true_on_policy.token_versions import TOKEN_VERSIONS


class ServingOptions(PluginOptions):
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="compute dtype; bfloat16 decodes faster on CPUs with bf16 units, its "
        "log-probs differ from the fp32 trainer's by ~1e-2 (train_rollout_* metrics)",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        description="where the engine keeps its weights and KV cache: cpu, cuda, or auto = "
        "cuda when available",
    )

    @field_validator("device")
    @classmethod
    def _device_present(cls, v: str) -> str:
        if v == "cuda":
            from miles_core.device import check_device

            check_device(v)  # a clear error on a machine without CUDA
        return v


def refuses_model(hf_config: dict[str, Any]) -> str | None:
    """Why the serving engine's forward (its model family's runner) would not run this model."""
    from types import SimpleNamespace

    from miles_core.models.family import runner_refuses

    return runner_refuses(SimpleNamespace(**hf_config))


@ENGINES.register("serving")
class Serving(EngineKind):
    routes = IN_PROCESS_ROUTES
    quantized_weights = True
    # our engine records MoE routes and the weight version of each token
    answers = frozenset({ROUTES.request_flag, TOKEN_VERSIONS.request_flag})
    Options = ServingOptions

    @classmethod
    def check_model(cls, hf_config: dict[str, Any]) -> str | None:
        return refuses_model(hf_config)

    @classmethod
    def compute_dtype(cls, options: Any) -> str:
        return options.dtype

    @classmethod
    def true_on_policy_refuses(cls, options: Any) -> str | None:
        if options.device == "cuda":
            return "rollout.engine_options.device cuda: the invariant kernels are checked on CPU"
        return None

    @classmethod
    def build(cls, setup: EngineSetup) -> BuiltEngine:
        from miles_core.engines.cpu.serving import ServingEngine

        o = setup.options
        engine = ServingEngine(
            setup.model,
            setup.tokenizer,
            seed=setup.seed,
            max_running=setup.batch,
            dtype=o.dtype,
            scheduler="caller",
            device=o.device,
            adapt_threads=not setup.beside_trainer,
            true_on_policy=setup.true_on_policy,
            precision=setup.precision,
            lora=setup.lora,
        )
        return BuiltEngine(engine)
