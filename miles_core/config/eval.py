"""The `eval:` section: evaluation of the policy while training runs."""

from __future__ import annotations

from pydantic import Field

from miles_core.config.base import PluginOptionsField, Strict, options_field, plugin_validators


def _modes():
    from miles_core.eval.mode import EVAL_MODES

    return EVAL_MODES


class EvalConfig(Strict):
    """Evaluation of the policy on fixed prompts of data.task while training runs."""

    mode: str = Field(
        "none",
        description="a module of miles_core/eval/modes/ or 'package.module:Mode'. shared: pause "
        "the producer and evaluate on the rollout engine between steps; dedicated: a separate "
        "engine server loaded from the version's checkpoint, training keeps going; external: "
        "POST the checkpoint URI and version to an evaluation service (mode_options.url) and "
        "poll for the result; none: no evaluation",
    )
    mode_options: PluginOptionsField = options_field("mode")
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

    _mode, _mode_options = plugin_validators("mode", lambda: _modes())
