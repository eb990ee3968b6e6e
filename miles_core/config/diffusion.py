"""The `diffusion:` section: an image run (a text-conditioned flow-matching model trained with an
image loss, `train.loss: flow_grpo | diffusion_nft`) instead of a text one.

The other sections keep their meaning: `rollout.prompts_per_step` scenes a step, each with
`rollout.n_samples_per_prompt` images (a GRPO group); `rollout.engine` embedded (the engine in
the trainer's process) or server (the image engine server); `rollout.mode` sync, one_step_off
or fully_async; `weight_sync` pushes the weights; `train` holds the optimizer and the loss;
`eval.every` scores the held-out scenes and logs an image grid; `checkpoint` and `tracking` as
for text. What only images have is here.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from miles_core.config.base import Strict

IMAGE_PRESETS = ("tiny", "small")  # diffusion/model.py: PRESETS


class DiffusionConfig(Strict):
    model: str = Field(
        "small",
        description="an image model preset to build (tiny, small) or the directory of a saved "
        "image model (local path)",
    )
    pretrain_steps: int = Field(
        0,
        ge=0,
        description="flow-matching steps on the training scenes before RL (the SFT stage; a "
        "preset only): 0 starts RL from the model as it is",
    )
    pretrain_lr: float = Field(2e-3, gt=0, description="pretraining's peak learning rate")
    pretrain_batch_size: int = Field(32, gt=0)
    sampling_steps: int = Field(10, ge=1, le=200, description="sampler steps per image")
    noise_level: float = Field(
        0.7,
        ge=0,
        le=10,
        description="η of Flow-GRPO's SDE sampler (0: the deterministic ODE, which has no "
        "log-probs: flow_grpo needs η > 0)",
    )
    guidance: float | None = Field(
        2.0, ge=0, le=100, description="classifier-free guidance w (null: none)"
    )
    reward: Literal["reward", "all", "shaped"] = Field(
        "reward",
        description="the checker's score that is the reward: reward (the mean of colour, "
        "count, shape, position), all (1 when all four hold) or shaped (their partial "
        "credits' mean, diffusion/checker.py)",
    )
    eval_samples_per_scene: int = Field(
        4, gt=0, description="ODE samples of each held-out scene per evaluation"
    )
    resolution: int | None = Field(
        None, gt=0, description="image size in pixels; null: the model's (checked before start)"
    )
    grid_prompts: list[str] | None = Field(
        None,
        max_length=64,
        description="the prompts of the image grid logged at each evaluation (null: three "
        "held-out scenes and three training ones)",
    )
    grid_samples: int = Field(4, ge=1, le=16, description="fixed-seed samples per grid prompt")

    @field_validator("grid_prompts")
    @classmethod
    def _scenes(cls, prompts: list[str] | None) -> list[str] | None:
        from miles_core.diffusion.scenes import Scene

        for text in prompts or ():
            Scene.parse(text)  # ValueError naming the word or the form
        return prompts
