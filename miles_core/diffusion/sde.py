"""Flow-GRPO's stochastic sampler step and its log-probability, shared by engine and trainer.

The rectified-flow convention: `x_σ = (1 − σ)·x0 + σ·ε` and the velocity is `v = ε − x0`. A
step goes from σ to σ' (`dt = σ' − σ < 0`). Flow-GRPO turns the Euler ODE step into an SDE
step with the same marginals, whose noise scale is `std_t = η·sqrt(σ / (1 − σ))` (at σ = 1
the denominator uses the schedule's second sigma σ_1 instead):

    mean   μ  = x·(1 + std_t²·dt / (2σ)) + v·(1 + std_t²·(1 − σ) / (2σ))·dt
    sample x' = μ + std_t·sqrt(−dt)·ε

The log-probability of x' is the Gaussian N(μ, (std_t·sqrt(−dt))²) density, averaged over all
image dims: one scalar per sample per step. η = 0 is the plain Euler step `x + v·dt`, which has
no log-probability. Everything runs in float32; a trainer that recomputes a stored step's mean
with the same model and `step_log_prob` gets the sampler's log-probability bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from diffusers import FlowMatchEulerDiscreteScheduler

if TYPE_CHECKING:
    from miles_core.diffusion.model import ImageModel

_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def _per_sample(value: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor:
    """`value` (a float, [] or [B]) as float32 [B, 1, 1, 1] to broadcast over `like` [B, ...]."""
    value = torch.as_tensor(value, dtype=torch.float32, device=like.device)
    return value.reshape(-1, *[1] * (like.ndim - 1)).expand(like.shape[0], *[1] * (like.ndim - 1))


def sde_step(
    x: torch.Tensor,
    v: torch.Tensor,
    sigma: torch.Tensor | float,
    sigma_next: torch.Tensor | float,
    eta: float,
    noise: torch.Tensor | None,
    sigma_1: float,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """(x_next, mean, std) of one step from `sigma` to `sigma_next` (floats or [B]).

    `v` is the model's velocity at `x`; `noise` is standard normal like `x` (None: only the
    mean and std, as when scoring a stored step; x_next is then None). `std` is the
    transition's standard deviation `std_t·sqrt(−dt)`, [B, 1, 1, 1]; it is 0 when η = 0, and
    x_next is then the Euler step `x + v·dt`.
    """
    if eta < 0:
        raise ValueError(f"eta is a noise scale and must be >= 0 (0: the ODE); got {eta}")
    x, v = x.float(), v.float()
    sigma, sigma_next = _per_sample(sigma, x), _per_sample(sigma_next, x)
    dt = sigma_next - sigma
    if eta == 0:
        mean = x + v * dt
        return (mean if noise is not None else None), mean, torch.zeros_like(dt)
    # σ = 1 would divide by zero: the first step's noise scale uses σ_1 in the denominator
    denominator = 1 - torch.where(sigma == 1, torch.full_like(sigma, sigma_1), sigma)
    std_t = eta * torch.sqrt(sigma / denominator)
    mean = (
        x * (1 + std_t**2 * dt / (2 * sigma)) + v * (1 + std_t**2 * (1 - sigma) / (2 * sigma)) * dt
    )
    std = std_t * torch.sqrt(-dt)
    x_next = mean + std * noise.float() if noise is not None else None
    return x_next, mean, std


def step_log_prob(x_next: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """float32 [B]: the log-density of `x_next` under N(mean, std²), averaged over all dims
    but the batch. Raises for an η = 0 step (std 0), which has no density."""
    if bool((std <= 0).any()):
        raise ValueError(
            "an ODE step (eta = 0) has no log-probability: sample with eta > 0 to train on it"
        )
    x_next, mean = x_next.float(), mean.float()
    log_prob = -((x_next.detach() - mean) ** 2) / (2 * std**2) - torch.log(std) - _LOG_SQRT_2PI
    return log_prob.mean(dim=tuple(range(1, log_prob.ndim)))


def schedule(scheduler: FlowMatchEulerDiscreteScheduler, steps: int) -> torch.Tensor:
    """float32 [steps + 1]: the scheduler's sigmas for `steps` steps, from 1 down to 0. The
    model's own scheduler is left untouched."""
    if steps < 1:
        raise ValueError(f"sampling needs at least one step; got steps={steps}")
    copy = FlowMatchEulerDiscreteScheduler.from_config(scheduler.config)
    copy.set_timesteps(steps)
    return copy.sigmas.to(torch.float32)


@dataclass
class Trajectory:
    """What a trainer needs to score a stochastic sample's steps again."""

    latents: torch.Tensor  # float32 [B, steps + 1, 3, S, S]: x at each sigma, noise first
    sigmas: torch.Tensor  # float32 [steps + 1]
    log_probs: torch.Tensor  # float32 [B, steps]: step j's log-prob of latents[:, j + 1]
    eta: float
    guidance: float | None


@torch.no_grad()
def sample(
    model: ImageModel,
    prompt_ids: torch.Tensor,
    steps: int,
    eta: float,
    guidance: float | None,
    generator: torch.Generator,
) -> tuple[torch.Tensor, Trajectory | None]:
    """(images, trajectory): images float32 [B, 3, S, S] clipped to [-1, 1] for the prompts
    `prompt_ids` [B, L], after `steps` steps from pure noise. η > 0 samples Flow-GRPO's SDE
    and returns the trajectory; η = 0 runs the Euler ODE and returns None for it. `generator`
    draws the initial noise and every step's noise, so a seed fixes the result."""
    size = model.image_size
    sigmas = schedule(model.scheduler, steps)
    sigma_1 = float(sigmas[1])
    x = torch.randn((prompt_ids.shape[0], 3, size, size), generator=generator)
    latents, log_probs = [x], []
    for j in range(steps):
        v = model.velocity(x, sigmas[j], prompt_ids, guidance)
        noise = torch.randn(x.shape, generator=generator) if eta > 0 else None
        x_next, mean, std = sde_step(x, v, sigmas[j], sigmas[j + 1], eta, noise, sigma_1)
        x = x_next if x_next is not None else mean
        if eta > 0:
            latents.append(x)
            log_probs.append(step_log_prob(x, mean, std))
    images = x.clamp(-1, 1)
    if eta == 0:
        return images, None
    trajectory = Trajectory(
        latents=torch.stack(latents, dim=1),
        sigmas=sigmas,
        log_probs=torch.stack(log_probs, dim=1),
        eta=eta,
        guidance=guidance,
    )
    return images, trajectory
