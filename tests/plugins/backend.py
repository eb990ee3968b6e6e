"""A trainer backend and a loss defined outside miles_core, as a user would write them: loaded
by import path (`train.backend: tests.plugins.backend:RecordingBackend`,
`train.loss: tests.plugins.backend:DoubledSFT`), nothing registered inside the package.

`RecordingBackend` is the registered `fsdp` backend (looked up by name, not imported) that
notes every call it serves in `CALLS`, so a test sees that the run really trained through it.
"""

from __future__ import annotations

from miles_core.train.backend import BACKENDS
from miles_core.train.losses.sft import SFTLoss

CALLS: list[str] = []


class RecordingBackend(BACKENDS.get("fsdp")):
    def __init__(self, *args, **kwargs):
        CALLS.append("init")
        super().__init__(*args, **kwargs)

    def _compute_log_probs(self, batch):
        CALLS.append(f"compute_log_probs:{len(batch)}")
        return super()._compute_log_probs(batch)

    def _train_step(self, batch, loss):
        CALLS.append(f"train_step:{loss}:{len(batch)}")
        return super()._train_step(batch, loss)

    def _save(self, directory):
        CALLS.append("save")
        super()._save(directory)


class DoubledSFT(SFTLoss):
    """Twice the SFT loss, with the loss-masked tokens each micro-batch saw as a stat."""

    def __call__(self, out, mb, cfg, denom):
        loss, stats = super().__call__(out, mb, cfg, denom)
        return 2 * loss, {"loss": 2 * stats["loss"], "masked_tokens": float(mb.mask.sum())}
