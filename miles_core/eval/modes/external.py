"""`external`: each due version's checkpoint URI is POSTed to an evaluation service, which is
polled for the result, while training keeps going (the contract: `eval/external.py`)."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from miles_core.eval.mode import EVAL_MODES, BackgroundOptions, EvalMode


class ExternalOptions(BackgroundOptions):
    url: str = Field(description="the evaluation service (POST {url}, GET {url}/{id})")
    poll_s: float = Field(1.0, gt=0, description="seconds between polls")


@EVAL_MODES.register("external")
class External(EvalMode):
    Options = ExternalOptions
    background = True

    @classmethod
    def runner(cls, config: Any, options: ExternalOptions, spec: Any) -> Any:
        from miles_core.eval.external import ExternalRunner
        from miles_core.processes.auth import env_key

        # a service the run did not start: the configured key, not the run's own
        key = config.network.api_key or env_key()
        return ExternalRunner(options.url, spec, options.poll_s, api_key=key)
