"""Flow-GRPO: PPO-clip over the per-step Gaussian log-probs of an image model's SDE sampler.

For each trained step j of a trajectory the trainer recomputes the step's mean with the current
model on the stored `x_j` (classifier-free guidance as sampled, the unconditional branch without
gradient) and scores the stored `x_{j+1}` with the sampler's own code (diffusion/sde.py):

    ratio  = exp(log p_θ(x_{j+1} | x_j) − log p_engine(x_{j+1} | x_j))
    loss   = max(−A·ratio, −A·clip(ratio, 1 − ε, 1 + ε)) + β·KL
    KL     = mean over dims of (μ_θ − μ_ref)² / (2 s²)

A is the sample's advantage (its group's, from `train.advantage_estimator`), clipped to
±`adv_clip`; s is the step's transition std `std_t·sqrt(−dt)`, so KL is the exact KL between the
two Gaussian steps, averaged over dims (Flow-GRPO's code divides by std_t² alone, without the
Δt; a β tuned there is Δt times ours). The KL has the gradient of μ_θ. Each row trains
`timestep_fraction` of its sampling steps: `random` draws them per row from the step's seed,
`first` takes the earliest (where the composition is decided).

With one optimizer step per rollout the first pass's ratio is exactly 1: the trainer's
recomputation equals the engine's log-prob bit for bit (`log_prob_mean_abs_diff` = 0).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch
from pydantic import Field

from miles_core.diffusion.loss import ImageMicroBatch, ImageModels, ImageNeeds
from miles_core.diffusion.sde import sde_step, step_log_prob
from miles_core.plugins import PluginOptions
from miles_core.train.loss import LOSSES


class FlowGRPOOptions(PluginOptions):
    clip_range: float = Field(1e-4, gt=0, lt=1, description="PPO clip range ε of the ratio")
    adv_clip: float = Field(5.0, gt=0, description="advantages are clipped to ± this")
    kl_coef: float = Field(0.0, ge=0, description="β of the KL to the initial policy")
    timestep_fraction: float = Field(
        0.6, gt=0, le=1, description="the share of each trajectory's sampling steps trained"
    )
    timesteps: Literal["random", "first"] = Field(
        "random", description="which steps: drawn per row, or the earliest"
    )


@LOSSES.register("flow_grpo")
class FlowGRPOLoss:
    modality = "image"
    Options = FlowGRPOOptions

    def config(self, options: Mapping[str, Any] | FlowGRPOOptions) -> FlowGRPOOptions:
        return options if isinstance(options, FlowGRPOOptions) else FlowGRPOOptions(**options)

    def aggregation(self, cfg: FlowGRPOOptions) -> str:
        return "sample_step_mean"

    def needs(self, cfg: FlowGRPOOptions) -> ImageNeeds:
        return ImageNeeds(reference=cfg.kl_coef > 0, trajectory=True)

    def trained_steps(self, cfg: FlowGRPOOptions, sampling_steps: int) -> int:
        return max(1, int(sampling_steps * cfg.timestep_fraction))

    def passes(self, cfg: FlowGRPOOptions, trained_steps: int) -> int:
        return trained_steps

    def __call__(
        self,
        models: ImageModels,
        mb: ImageMicroBatch,
        k: int,
        cfg: FlowGRPOOptions,
        denom: float,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        x, x_next, sigma, sigma_next, old = mb.gather_steps(k)
        sigma_1 = float(mb.sigmas[1])
        v = models.policy(x, sigma, mb.ids, mb.guidance, detach_unconditional=True)
        _, mean, std = sde_step(x, v, sigma, sigma_next, mb.eta, None, sigma_1)
        log_prob = step_log_prob(x_next, mean, std)
        ratio = torch.exp(log_prob - old)
        adv = mb.advantages.clamp(-cfg.adv_clip, cfg.adv_clip)
        clipped = ratio.clamp(1 - cfg.clip_range, 1 + cfg.clip_range)
        pg = torch.maximum(-adv * ratio, -adv * clipped)
        per_row = pg
        stats = {
            "_pg_loss": float(pg.detach().sum()),
            "_ratio": float(ratio.detach().sum()),
            "_clipfrac": float(((ratio - clipped).abs() > 0).float().sum()),
            "_log_prob_mean_abs_diff": float((log_prob.detach() - old).abs().sum()),
        }
        if cfg.kl_coef > 0:
            assert models.reference is not None
            with torch.no_grad():
                v_ref = models.reference(x, sigma, mb.ids, mb.guidance)
                _, mean_ref, _ = sde_step(x, v_ref, sigma, sigma_next, mb.eta, None, sigma_1)
            dims = tuple(range(1, mean.ndim))
            kl = ((mean - mean_ref) ** 2).mean(dim=dims) / (2 * std.reshape(-1) ** 2)
            per_row = per_row + cfg.kl_coef * kl
            stats["_kl"] = float(kl.detach().sum())
        return per_row.sum() / denom, stats
