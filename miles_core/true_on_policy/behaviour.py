"""The behaviour log-probs of a batch: each response token's log-prob under the weights that
generated it, where those are an earlier policy version than the trainer's (a sample generated
ahead of the trainer, or resumed across a push). The engine recorded each token's version
(`token_versions.py`); the trainer keeps its weights of the versions a sample may still come
from (`train/kept_weights.py`) and runs its own forward under each version the batch holds, so
`train/train_rollout_logprob_abs_diff` compares the engine and the trainer on the same weights,
and the policy's lag is measured apart (`train/policy_lag_logprob_abs_diff`)."""

from __future__ import annotations

import logging
import math

import numpy as np

from miles_core.train.backend import TrainerBackend
from miles_core.train.batch import TrainBatch
from miles_core.true_on_policy.token_versions import TOKEN_VERSIONS, UNKNOWN

log = logging.getLogger("miles")


def behaviour_log_probs(
    trainer: TrainerBackend, batch: TrainBatch, version: int, max_lag: int
) -> list[list[float]] | None:
    """`TrainBatch.behaviour_log_probs` of `batch`, trained by `trainer` holding policy
    `version`, whose samples lag it by at most `max_lag` versions: NaN for a token of `version`
    (π_old's log-prob is its own) or of no known version; None when no token is stale. The
    trainer keeps its current weights for the batches to come."""
    if max_lag <= 0:
        return None
    trainer.keep_weights(version, oldest=version - max_lag)
    rows = batch.token_fields.get(TOKEN_VERSIONS.name)
    if rows is None:
        return None
    stale = sorted({int(v) for r in rows for v in np.unique(r)} - {version, UNKNOWN})
    if not stale:
        return None
    out = [[math.nan] * n for n in batch.response_lengths]
    kept = trainer.kept_versions()
    for v in stale:
        if v not in kept:  # e.g. generated before a resume: its weights are gone
            log.warning(
                "true on-policy: no weights kept for policy version %d; its tokens are "
                "compared under version %d",
                v,
                version,
            )
            continue
        for row, made, lps in zip(out, rows, trainer.compute_log_probs_at(v, batch), strict=True):
            for j in np.flatnonzero(made == v):
                row[j] = lps[j]
    return out
