"""`dedicated`: a separate engine server loaded from each due version's checkpoint scores it,
while training keeps going."""

from __future__ import annotations

from typing import Any

from miles_core.eval.mode import EVAL_MODES, BackgroundOptions, EvalMode


@EVAL_MODES.register("dedicated")
class Dedicated(EvalMode):
    Options = BackgroundOptions
    background = True

    @classmethod
    def runner(cls, config: Any, options: BackgroundOptions, spec: Any) -> Any:
        from miles_core.eval.dedicated import DedicatedRunner

        return DedicatedRunner(
            spec, config.checkpoint.storage_options, port_range=config.network.ports
        )
