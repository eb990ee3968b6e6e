"""What a backend's forward takes (`MicroBatch`) and gives (`TokenOutputs`), and what a loss asks
of it (`LossNeeds`). Everything is response-aligned: [B, R], R = the longest response."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from miles_core.train.advantage_transform import transformed
from miles_core.train.batch import PaddedBatch, TrainBatch
from miles_core.train.shared_prefix import SharedPrefix


@dataclass(frozen=True)
class LossNeeds:
    """entropy: none | value (for metrics, no gradient) | grad (in the loss);
    reference: log-probs of the frozen initial policy (KL to reference);
    gather: the name of an integer per-token field [R, k] of token ids whose log-probs the
    forward returns as well (`TokenOutputs.gathered`, with gradient), "" for none."""

    entropy: Literal["none", "value", "grad"] = "none"
    reference: bool = False
    gather: str = ""


@dataclass
class MicroBatch:
    """One micro-batch of this rank: its rows (`batch`, lists) and their padded tensors on the
    trainer's device (`padded`). Per-token fields of the batch reach a loss through both.
    `prefix`: the same rows as distinct prompts + responses, for a forward that runs each
    prompt once (`shared_prefix.py`); None where that saves nothing or was not asked for."""

    batch: TrainBatch
    padded: PaddedBatch
    prefix: SharedPrefix | None = None

    @classmethod
    def build(
        cls,
        batch: TrainBatch,
        pad_id: int,
        device: torch.device,
        share_prompts: bool = False,
        width: int = 0,
    ) -> MicroBatch:
        padded = PaddedBatch.build(batch, pad_id, width)
        prefix = SharedPrefix.build(batch, pad_id) if share_prompts else None
        if device.type != "cpu":
            padded = padded.to(device)
            prefix = prefix.to(device) if prefix is not None else None
        return cls(batch, padded, prefix)

    @property
    def mask(self) -> torch.Tensor:
        return self.padded.mask

    @property
    def temperature(self) -> float:
        return self.batch.temperature

    def per_token(self, rows: list[list[float]]) -> torch.Tensor:
        """Response-aligned rows as a [B, R] float tensor on the device (0 past each row)."""
        return self.padded.per_token(rows)

    def per_row(self, values: list[float]) -> torch.Tensor:
        """One float per row, as a [B] tensor on the device."""
        return torch.tensor(values, dtype=torch.float32, device=self.mask.device)

    def advantages(self, old: torch.Tensor) -> torch.Tensor:
        """Per-token advantages [B, R]: each row's advantage, through the batch's advantage
        transforms (which may read `old`, π_old's log-probs, and the per-token fields)."""
        if self.batch.advantages is None:
            raise ValueError("policy loss needs advantages")
        adv = self.per_row(self.batch.advantages).unsqueeze(1).expand_as(self.mask)
        if self.batch.advantage_transforms:
            adv = transformed(adv, old, self, self.batch.advantage_transforms)
        return adv

    def old_log_probs(self, current: torch.Tensor) -> torch.Tensor:
        """π_old's per-token log-probs [B, R], no gradient: the batch's recomputed
        `old_log_probs`, or, when `old_is_current` (one optimizer step per rollout), `current`
        (this forward's log-probs) detached: the same values a recompute would give, without
        the second forward."""
        if self.batch.old_is_current:
            return current.detach()
        if self.batch.old_log_probs is None:
            raise ValueError(
                "this loss needs the old log-probs: set TrainBatch.old_log_probs "
                "(trainer.compute_log_probs) or old_is_current"
            )
        return self.per_token(self.batch.old_log_probs)


@dataclass
class TokenOutputs:
    """A forward's result for a micro-batch: the policy's per-token log-probs (with gradient in a
    train step), its entropy if asked (detached unless `LossNeeds.entropy == "grad"`), the
    reference policy's log-probs if asked (no gradient), and the policy's log-probs of the ids
    of field `LossNeeds.gather` if asked ([B, R, k], with gradient)."""

    log_probs: torch.Tensor
    entropy: torch.Tensor | None = None
    ref_log_probs: torch.Tensor | None = None
    gathered: torch.Tensor | None = None
