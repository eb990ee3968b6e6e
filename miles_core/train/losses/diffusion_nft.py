"""DiffusionNFT: reward-weighted flow matching on the final images, with no sampler log-probs.

The engine samples with the deterministic ODE (any sampler would do); training noises each final
image `x0` to a level t drawn from the sampling schedule, `x_t = (1 − t)·x0 + t·ε`, and asks two
predictions of it: the current policy's `v_θ` (with gradient) and an old copy's `v_old` (which
trails the policy: after every optimizer step `old ← d·old + (1 − d)·θ`, `old_decay` d). The
implicit positive and negative policies and their clean-image estimates are

    v+ = β·v_θ + (1 − β)·v_old      v− = (1 + β)·v_old − β·v_θ      x0± = x_t − t·v±

and a sample's reward weight is `r = clamp(clip(A)/A_max / 2 + 0.5, 0, 1)` (A its advantage,
clipped to ±A_max): the loss pulls x0+ toward x0 for good samples and x0− toward x0 for bad
ones, each error divided by its own mean absolute error (no gradient, floor 1e-5):

    loss = A_max · mean[r·‖x0+ − x0‖²/w+ + (1 − r)·‖x0− − x0‖²/w−] / β  (+ kl_coef·‖v_θ − v_ref‖²)

The prediction is classifier-free: no guidance in training (the sampler's guidance is the
engine's business).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from pydantic import Field

from miles_core.diffusion.loss import ImageMicroBatch, ImageModels, ImageNeeds
from miles_core.plugins import PluginOptions
from miles_core.train.loss import LOSSES

WEIGHT_FLOOR = 1e-5


class DiffusionNFTOptions(PluginOptions):
    beta: float = Field(1.0, gt=0, description="β: how far v± step from the old policy")
    adv_clip: float = Field(5.0, gt=0, description="A_max: advantages are clipped to ± this")
    old_decay: float = Field(
        0.5, ge=0, lt=1, description="d: the old policy's decay toward the current one per step"
    )
    kl_coef: float = Field(0.0, ge=0, description="weight of ‖v_θ − v_ref‖²")


@LOSSES.register("diffusion_nft")
class DiffusionNFTLoss:
    modality = "image"
    Options = DiffusionNFTOptions

    def config(self, options: Mapping[str, Any] | DiffusionNFTOptions) -> DiffusionNFTOptions:
        if isinstance(options, DiffusionNFTOptions):
            return options
        return DiffusionNFTOptions(**options)

    def aggregation(self, cfg: DiffusionNFTOptions) -> str:
        return "sample_step_mean"

    def needs(self, cfg: DiffusionNFTOptions) -> ImageNeeds:
        return ImageNeeds(reference=cfg.kl_coef > 0, old_policy=True, trajectory=False)

    def trained_steps(self, cfg: DiffusionNFTOptions, sampling_steps: int) -> int:
        return 1

    def passes(self, cfg: DiffusionNFTOptions, trained_steps: int) -> int:
        return 1

    def __call__(
        self,
        models: ImageModels,
        mb: ImageMicroBatch,
        k: int,
        cfg: DiffusionNFTOptions,
        denom: float,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        assert models.old is not None and mb.noise_levels is not None and mb.noise is not None
        x0 = mb.images
        t = mb.noise_levels.reshape(-1, 1, 1, 1)
        x_t = (1 - t) * x0 + t * mb.noise
        v = models.policy(x_t, mb.noise_levels, mb.ids)
        with torch.no_grad():
            v_old = models.old(x_t, mb.noise_levels, mb.ids)
        positive = x_t - t * (cfg.beta * v + (1 - cfg.beta) * v_old)
        negative = x_t - t * ((1 + cfg.beta) * v_old - cfg.beta * v)
        dims = tuple(range(1, x0.ndim))

        def weight(pred: torch.Tensor) -> torch.Tensor:
            err = (pred.detach().double() - x0.double()).abs().mean(dim=dims)
            return err.clamp_min(WEIGHT_FLOOR).float()

        adv = mb.advantages.clamp(-cfg.adv_clip, cfg.adv_clip)
        r = (adv / cfg.adv_clip / 2 + 0.5).clamp(0, 1)
        pos = ((positive - x0) ** 2).mean(dim=dims) / weight(positive)
        neg = ((negative - x0) ** 2).mean(dim=dims) / weight(negative)
        per_row = cfg.adv_clip * (r * pos + (1 - r) * neg) / cfg.beta
        stats = {"_nft_loss": float(per_row.detach().sum())}
        if cfg.kl_coef > 0:
            assert models.reference is not None
            with torch.no_grad():
                v_ref = models.reference(x_t, mb.noise_levels, mb.ids)
            kl = ((v - v_ref) ** 2).mean(dim=dims)
            per_row = per_row + cfg.kl_coef * kl
            stats["_kl"] = float(kl.detach().sum())
        return per_row.sum() / denom, stats
