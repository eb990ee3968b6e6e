"""A step's image rollout: prompts drawn from the training scenes, images from the engine,
rewards from the checker, advantages from the run's estimator.

Each step draws `prompts` scenes from the training split with a generator seeded by (seed,
step), so a resumed run draws the same prompts for the same step. The engine samples `n`
images per prompt in one request (prompt-major rows: a GRPO group is `n` consecutive rows); the
checker scores each against its scene (diffusion/checker.py), and the reward is one of its
attributes (`reward`: the mean of the four; `all`: 1 when every one holds). Advantages come
from `train.advantage_estimator` over each prompt's group, as for text (train/advantage.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from miles_core.diffusion.checker import ATTRIBUTES, SCORES, check
from miles_core.diffusion.scenes import Scene, prompt_ids
from miles_core.diffusion.wire import RolloutOutput, RolloutRequest
from miles_core.train.advantage import ADVANTAGES
from miles_core.types import Sample, SampleGroup, Status


@dataclass
class ImageRollout:
    """One step's samples, prompt-major (`n` rows per prompt)."""

    step: int
    scenes: list[Scene]  # one per row
    ids: torch.Tensor  # long [N, L]
    images: torch.Tensor  # float32 [N, 3, S, S]
    sigmas: torch.Tensor  # float32 [T + 1]
    latents: torch.Tensor | None  # float32 [N, T + 1, 3, S, S] (SDE rollouts)
    log_probs: torch.Tensor | None  # float32 [N, T]
    guidance: float | None
    eta: float
    weight_version: int
    scores: list[dict[str, float]]  # the checker's, one per row
    rewards: torch.Tensor  # float32 [N]
    advantages: torch.Tensor  # float32 [N]
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Sampling:
    """How a run's engine samples: steps, SDE noise level η (0: the ODE), guidance."""

    steps: int
    eta: float
    guidance: float | None

    def request(self, scenes: list[Scene], n: int, seed: int, rollout: bool) -> RolloutRequest:
        """`n` images of each scene: the SDE with its trajectory when `rollout` (and η > 0),
        else the ODE's images alone."""
        sde = rollout and self.eta > 0
        return RolloutRequest(
            prompt=[s.prompt for s in scenes],
            num_outputs_per_prompt=n,
            num_inference_steps=self.steps,
            guidance_scale=self.guidance,
            seed=seed,
            rollout=sde,
            rollout_noise_level=self.eta if sde else 0.0,
        )


def step_scenes(train: list[Scene], prompts: int, seed: int, step: int) -> list[Scene]:
    """Step `step`'s prompts: `prompts` distinct training scenes (repeats only when there are
    fewer scenes than prompts), from a generator seeded by (seed, step)."""
    rng = np.random.default_rng([seed, step])
    picks = rng.choice(len(train), prompts, replace=prompts > len(train))
    return [train[int(i)] for i in picks]


def score_images(images: torch.Tensor, scenes: list[Scene]) -> list[dict[str, float]]:
    return [check(image, scene) for image, scene in zip(images.numpy(), scenes, strict=True)]


def mean_scores(
    scores: list[dict[str, float]], prefix: str, names: tuple[str, ...] = SCORES
) -> dict[str, float]:
    """`<prefix><name>`: the mean of each checker attribute in `names` over `scores`."""
    return {
        f"{prefix}{name}": float(np.mean([s[name] for s in scores])) if scores else 0.0
        for name in names
    }


def advantages_of(
    rewards: torch.Tensor, n: int, step: int, estimator: str, options
) -> torch.Tensor:
    """Each row's advantage from its group of `n` (train.advantage_estimator)."""
    groups = []
    for g in range(len(rewards) // n):
        samples = [
            Sample(
                group_index=g,
                index=g * n + i,
                rollout_id=f"{step}-{g * n + i}",
                prompt="",
                tokens=[],
                response_length=0,
                loss_mask=[],
                rollout_log_probs=[],
                reward=float(rewards[g * n + i]),
                status=Status.COMPLETED,
            )
            for i in range(n)
        ]
        groups.append(SampleGroup(g, samples))
    return torch.tensor(ADVANTAGES.get(estimator)(groups, options), dtype=torch.float32)


def image_rollout(
    engine,
    scenes: list[Scene],
    n: int,
    sampling: Sampling,
    seed: int,
    step: int,
    reward: str,
    estimator: str,
    estimator_options,
    trajectory: bool,
    per_request: int | None = None,
) -> ImageRollout:
    """Step `step`'s rollout of `scenes`, scored and with advantages. `trajectory`: sample the
    SDE and keep its trajectory (Flow-GRPO), else the ODE (DiffusionNFT).

    The prompts go to the engine `per_request` at a time (None: all in one request), and the
    engine samples each request's images as one batch. The trainer recomputes a trajectory's
    log-probs in micro-batches of exactly those rows: a forward's rounding may depend on its
    batch's shape (a GEMM's blocking), never on the other rows' values, so the same rows give
    the same bits."""
    per_request = per_request or len(scenes)
    requests = [
        sampling.request(scenes[i : i + per_request], n, seed + i, rollout=trajectory)
        for i in range(0, len(scenes), per_request)
    ]
    outs = [engine.rollout(request) for request in requests]
    out = _joined(outs)
    request = requests[0]
    rows = [s for s in scenes for _ in range(n)]
    scores = score_images(out.images, rows)
    rewards = torch.tensor([s[reward] for s in scores], dtype=torch.float32)
    advantages = advantages_of(rewards, n, step, estimator, estimator_options)
    grouped = rewards.reshape(-1, n)
    metrics = mean_scores(scores, "rollout/reward_", (*ATTRIBUTES, "all"))
    metrics |= {
        "rollout/reward_mean": float(rewards.mean()),
        "rollout/reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0,
        # groups whose samples all scored alike: zero advantage, nothing to learn from
        "rollout/flat_group_fraction": float((grouped.std(dim=1) == 0).float().mean()),
        "rollout/weight_version": float(out.weight_version),
    }
    return ImageRollout(
        step=step,
        scenes=rows,
        ids=torch.tensor([prompt_ids(s.prompt) for s in rows], dtype=torch.long),
        images=out.images,
        sigmas=out.sigmas,
        latents=out.latents,
        log_probs=out.log_probs,
        guidance=sampling.guidance,
        eta=request.eta,
        weight_version=out.weight_version,
        scores=scores,
        rewards=rewards,
        advantages=advantages,
        metrics=metrics,
    )


def _joined(outs: list[RolloutOutput]) -> RolloutOutput:
    """The answers to several requests of one step as one, rows in request order."""
    if len(outs) == 1:
        return outs[0]

    def cat(name: str) -> torch.Tensor | None:
        parts = [getattr(o, name) for o in outs]
        return None if parts[0] is None else torch.cat(parts)

    return RolloutOutput(
        images=cat("images"),
        latents=cat("latents"),
        sigmas=outs[0].sigmas,
        log_probs=cat("log_probs"),
        weight_version=min(o.weight_version for o in outs),
    )
