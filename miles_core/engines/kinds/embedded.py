"""`embedded`: our batched sampler on the trainer's HF modules, in the trainer's process
(weights handed over as tensors: weight_sync.transport colocated)."""

from __future__ import annotations

from typing import Any

from miles_core.engines.protocol import IN_PROCESS_ROUTES
from miles_core.engines.registry import ENGINES, BuiltEngine, EngineKind, EngineSetup
from miles_core.true_on_policy.token_versions import TOKEN_VERSIONS


@ENGINES.register("embedded")
class Embedded(EngineKind):
    routes = IN_PROCESS_ROUTES
    quantized_weights = True
    answers = frozenset({TOKEN_VERSIONS.request_flag})

    @classmethod
    def true_on_policy_refuses(cls, options: Any) -> str | None:
        return None

    @classmethod
    def build(cls, setup: EngineSetup) -> BuiltEngine:
        from miles_core.engines.cpu.embedded import EmbeddedEngine

        # taking turns with the trainer, the engine owns the process: it picks its threads
        engine = EmbeddedEngine(
            setup.model,
            setup.tokenizer,
            seed=setup.seed,
            adapt_threads=not setup.beside_trainer,
            true_on_policy=setup.true_on_policy,
            precision=setup.precision,
            lora=setup.lora,
        )
        return BuiltEngine(engine)
