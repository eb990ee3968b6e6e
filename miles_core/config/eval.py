"""The `eval:` section: evaluation of the policy while training runs."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from miles_core.config.base import Strict


class EvalConfig(Strict):
    """Evaluation of the policy on fixed prompts of data.task while training runs."""

    mode: Literal["none", "shared", "dedicated", "external"] = Field(
        "none",
        description="shared: pause the producer and evaluate on the rollout engine between "
        "steps; dedicated: a separate engine server loaded from the version's checkpoint, "
        "training keeps going; external: POST the checkpoint URI and version to eval.url and "
        "poll for the result; none: no evaluation",
    )
    every: int = Field(
        0,
        ge=0,
        description="evaluate the policy after every N training steps (and after the last); "
        "dedicated/external evaluate checkpoints, so N must be a multiple of "
        "checkpoint.interval; 0 = after the last step only",
    )
    prompts: int = Field(32, gt=0, description="fixed evaluation prompts (data.task's generator)")
    seed: int = Field(1_000_003, description="seed of the evaluation prompts (added to data.seed)")
    max_new_tokens: int | None = Field(None, gt=0, description="default: rollout.max_new_tokens")
    greedy: bool = Field(True, description="greedy decoding (top_k 1); false samples as rollout")
    timeout_s: float = Field(
        300.0, gt=0, description="an evaluation running longer is logged as failed (eval/errors)"
    )
    max_in_flight: int = Field(
        2, ge=1, description="dedicated/external: more pending evaluations are skipped (logged)"
    )
    url: str | None = Field(
        None, description="external: the evaluation service (POST {url}, GET {url}/{id})"
    )
    poll_s: float = Field(1.0, gt=0, description="external: seconds between polls")

    @model_validator(mode="after")
    def _url_for_external(self) -> EvalConfig:
        if (self.mode == "external") != bool(self.url):
            raise ValueError("eval.url and eval.mode: external go together")
        return self
