"""Thin Prefect tasks: each calls one miles_core function and adds what Prefect is good at
(names in the UI, per-phase timing, logging). No RL logic lives here. No retries: a step-level
task runs collectives on every trainer rank, and a retry from rank 0 alone would not line up."""

from tasks.checkpoint import save_checkpoint
from tasks.evaluate import collect_evaluations, evaluate_policy
from tasks.rollout import rollout_batch
from tasks.setup import check_inputs, prepare_model, prepare_runtime, resumed_config, start_tracking
from tasks.sft import sft_train
from tasks.train import train_step
from tasks.weights import update_weights

__all__ = [
    "check_inputs",
    "collect_evaluations",
    "evaluate_policy",
    "resumed_config",
    "prepare_model",
    "prepare_runtime",
    "rollout_batch",
    "save_checkpoint",
    "sft_train",
    "start_tracking",
    "train_step",
    "update_weights",
]
