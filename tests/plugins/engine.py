"""A rollout engine defined outside miles_core, as a user would write one: named by import path
(`rollout.engine: tests.plugins.engine:CountingEngine`) with an option of its own
(`rollout.engine_options.record`), nothing registered inside the package.

It is our embedded sampler, in the trainer's process, that records how many requests each
generate call carried, so a test sees that the run's rollouts went through it.
"""

from __future__ import annotations

from pydantic import Field

from miles_core.engines.cpu.embedded import EmbeddedEngine
from miles_core.engines.protocol import IN_PROCESS_ROUTES
from miles_core.engines.registry import BuiltEngine, EngineKind, EngineSetup
from miles_core.plugins import PluginOptions


class CountingOptions(PluginOptions):
    record: str = Field(description="file that gets one line per generate call: its requests")


class _Counting(EmbeddedEngine):
    record = ""

    def generate(self, requests):
        with open(self.record, "a") as f:
            f.write(f"{len(requests)}\n")
        return super().generate(requests)


class CountingEngine(EngineKind):
    routes = IN_PROCESS_ROUTES
    Options = CountingOptions

    @classmethod
    def build(cls, setup: EngineSetup) -> BuiltEngine:
        engine = _Counting(setup.model, setup.tokenizer, seed=setup.seed)
        engine.record = setup.options.record
        return BuiltEngine(engine)
