"""`shared`: between steps, the producer held, the rollout engine scores the fixed evaluation
prompts with the weights it serves (the starting policy too)."""

from __future__ import annotations

from miles_core.eval.mode import EVAL_MODES, EvalMode


@EVAL_MODES.register("shared")
class Shared(EvalMode):
    pass
