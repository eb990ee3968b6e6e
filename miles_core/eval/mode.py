"""Evaluation modes (`eval.mode`): where a policy version due for evaluation is scored while
training runs. A mode is a class in `eval/modes/` (`@EVAL_MODES.register(name)`) or one named by
import path; its settings are its `Options` (`eval.mode_options`).

- `enabled`: whether the run evaluates at all (`none` does not);
- `background`: the mode scores saved checkpoints beside training (the trainer never waits; a
  version is evaluated from its checkpoint, so `eval.every` follows `checkpoint.interval`),
  through the `runner(config, options, spec)` it builds; otherwise it scores the rollout
  engine's current weights between steps (`shared`).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from miles_core.plugins import NoOptions, PluginOptions, Registry, subclass_of


class BackgroundOptions(PluginOptions):
    max_in_flight: int = Field(
        2, ge=1, description="more pending evaluations than this are skipped (logged)"
    )


class EvalMode:
    Options: type[PluginOptions] = NoOptions
    enabled = True
    background = False

    @classmethod
    def runner(cls, config: Any, options: Any, spec: Any) -> Any:
        """A background mode's runner (`eval/evaluators.py: BackgroundEvaluator` drives it)."""
        raise NotImplementedError


EVAL_MODES: Registry[type[EvalMode]] = Registry(
    "evaluation mode",
    "eval.mode",
    package="miles_core.eval.modes",
    example="package.module:Mode",
    load=subclass_of(EvalMode, "evaluation mode"),
)
