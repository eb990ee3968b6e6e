"""SFT: masked cross-entropy over the loss-masked tokens, divided by the global token count."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from miles_core.plugins import NoOptions
from miles_core.train.forward import LossNeeds, MicroBatch, TokenOutputs
from miles_core.train.loss import LOSSES
from miles_core.train.loss_terms import aggregate


@LOSSES.register("sft")
class SFTLoss:
    def config(self, options: Mapping[str, Any]) -> NoOptions:
        return NoOptions(**(options or {}))

    def aggregation(self, cfg: NoOptions) -> str:
        return "token_mean"

    def needs(self, cfg: NoOptions) -> LossNeeds:
        return LossNeeds()

    def __call__(
        self, out: TokenOutputs, mb: MicroBatch, cfg: NoOptions, denom: float
    ) -> tuple[torch.Tensor, dict[str, float]]:
        nll = aggregate(-out.log_probs, mb.mask, "token_mean", denom)
        return nll, {"loss": float(nll.detach())}
