"""`none`: the run does not evaluate (agentic runs evaluate with agent.eval_episodes)."""

from __future__ import annotations

from miles_core.eval.mode import EVAL_MODES, EvalMode


@EVAL_MODES.register("none")
class NoEvaluation(EvalMode):
    enabled = False
