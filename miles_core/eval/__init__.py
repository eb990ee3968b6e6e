"""Evaluation of policy versions: one scoring function, three modes (shared, dedicated,
external), and the registry side (nested runs, the `best-eval` alias)."""

from miles_core.eval.evaluators import BackgroundEvaluator, EvalJob, EvalOutcome, SharedEvaluator
from miles_core.eval.scoring import EvalSpec, score_model_dir, score_policy

__all__ = [
    "BackgroundEvaluator",
    "EvalJob",
    "EvalOutcome",
    "EvalSpec",
    "SharedEvaluator",
    "score_model_dir",
    "score_policy",
]
