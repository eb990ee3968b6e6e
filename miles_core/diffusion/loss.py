"""What an image loss gets: the micro-batch of a rollout's images and the models to score it.

Image losses register in the same registry as the text losses (`train/loss.py: LOSSES`, chosen
by `train.loss`, their settings in `train.loss_options`) and say so with `modality = "image"`;
a config refuses an image loss in a text run and the other way round. The image trainer
(trainer.py) calls one the way the text step loop calls a text loss, once per micro-batch and
pass: `passes(cfg)` backward passes per micro-batch (Flow-GRPO: one per trained sampling step,
so activations of one step are alive at a time; DiffusionNFT: one), each returning the pass's
loss already divided by the optimizer step's denominator, and its statistics (sums).

A statistic named `_x` is a sum over (sample, step) pairs, reported as `x` divided by their
count; any other is summed as it is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

# velocity(x, sigma, ids, guidance=None, detach_unconditional=False) → v
Velocity = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class ImageNeeds:
    """What a loss needs beyond the policy: the reference policy (a KL term), an old copy of
    the policy that trails it (DiffusionNFT), a trajectory with per-step log-probs (the engine
    samples the SDE; otherwise the deterministic ODE)."""

    reference: bool = False
    old_policy: bool = False
    trajectory: bool = True


@dataclass
class ImageModels:
    policy: Velocity  # with gradient
    reference: Velocity | None = None  # without
    old: Velocity | None = None  # without


@dataclass
class ImageMicroBatch:
    """Rows of one rollout (B images), on the trainer's device."""

    ids: torch.Tensor  # long [B, L]: the prompts' word ids
    advantages: torch.Tensor  # float32 [B]
    images: torch.Tensor  # float32 [B, 3, S, S]: the final samples, clipped to [-1, 1]
    sigmas: torch.Tensor  # float32 [T + 1]: the sampling schedule (T steps)
    guidance: float | None  # the sampler's classifier-free guidance
    eta: float  # the sampler's noise level (0: the ODE)
    latents: torch.Tensor | None = None  # float32 [B, T + 1, 3, S, S]
    old_log_probs: torch.Tensor | None = None  # float32 [B, T]: the engine's
    steps: torch.Tensor | None = None  # long [B, K]: each row's trained step indices
    # DiffusionNFT: each row's noise level and noise, drawn by the trainer from the step's seed
    noise_levels: torch.Tensor | None = None  # float32 [B]
    noise: torch.Tensor | None = None  # float32 [B, 3, S, S]

    def gather_steps(self, k: int) -> tuple[torch.Tensor, ...]:
        """(x_j, x_{j+1}, σ_j, σ_{j+1}, engine log-prob) of each row's k-th trained step j."""
        assert self.latents is not None and self.steps is not None
        assert self.old_log_probs is not None
        rows = torch.arange(len(self.ids), device=self.latents.device)
        j = self.steps[:, k]
        return (
            self.latents[rows, j],
            self.latents[rows, j + 1],
            self.sigmas[j],
            self.sigmas[j + 1],
            self.old_log_probs[rows, j],
        )


class ImageLoss(Protocol):
    modality: str  # "image"
    Options: type

    def config(self, options: Any) -> Any: ...

    def aggregation(self, cfg: Any) -> str:
        """`sample_step_mean`: the denominator is the optimizer step's (sample, step) pairs."""
        ...

    def needs(self, cfg: Any) -> ImageNeeds: ...

    def trained_steps(self, cfg: Any, sampling_steps: int) -> int:
        """How many of a trajectory's sampling steps each row trains (K)."""
        ...

    def passes(self, cfg: Any, trained_steps: int) -> int: ...

    def __call__(
        self, models: ImageModels, mb: ImageMicroBatch, k: int, cfg: Any, denom: float
    ) -> tuple[torch.Tensor, dict[str, float]]: ...


def modality_of(loss: Any) -> str:
    """ "image" for an image loss, "text" for every other."""
    return getattr(loss, "modality", "text")
