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

from typing import Any, Literal

from pydantic import Field, field_validator

from miles_core.config.base import Strict

IMAGE_PRESETS = ("tiny", "small", "unet-tiny", "unet-small")  # diffusion/model.py: PRESETS


class DiffusionConfig(Strict):
    model: str = Field(
        "unet-small",
        description="an image model preset to build (tiny, small, unet-tiny, unet-small) or "
        "the directory of a saved image model (local path)",
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

    def check_run(self, run: Any) -> None:
        """What an image run takes of the other sections (`run`: the RunConfig); each refusal
        names its setting."""
        from miles_core.diffusion.server import IMAGE_ENGINE_ROUTES
        from miles_core.eval.mode import EVAL_MODES
        from miles_core.train.loss import LOSSES
        from miles_core.weights.transport import TRANSPORTS

        r, t, ws = run.rollout, run.train, run.weight_sync
        if r.engine not in IMAGE_ENGINE_ROUTES:
            raise ValueError(
                f"rollout.engine {r.engine}: an image run's engine is one of "
                f"{' | '.join(IMAGE_ENGINE_ROUTES)}"
            )
        routes = IMAGE_ENGINE_ROUTES[r.engine]
        if TRANSPORTS.get(ws.transport).route not in routes:
            fitting = [n for n in TRANSPORTS.names() if TRANSPORTS.get(n).route in routes]
            raise ValueError(
                f"weight_sync.transport {ws.transport} cannot push to an image engine "
                f"{r.engine}: use {' | '.join(fitting)}"
            )
        if ws.dtype != "float32":
            raise ValueError(
                "weight_sync.dtype: an image run pushes float32 (the trainer recomputes the "
                "engine's log-probs bit for bit)"
            )
        loss = LOSSES.get(t.loss)
        if loss.needs(loss.config(t.loss_options or {})).trajectory and self.noise_level == 0:
            raise ValueError(
                f"train.loss {t.loss} trains on the SDE's per-step log-probs: "
                "diffusion.noise_level must be > 0 (0 is the deterministic ODE)"
            )
        if self.pretrain_steps and self.model not in IMAGE_PRESETS:
            raise ValueError(
                "diffusion.pretrain_steps pretrains a new model of a preset "
                f"({' | '.join(IMAGE_PRESETS)}); diffusion.model {self.model!r} is a saved model"
            )
        if t.world_size != 1:
            raise ValueError("train.world_size: the image trainer runs one rank for now")
        if t.micro_batch_size % r.n_samples_per_prompt:
            raise ValueError(
                f"train.micro_batch_size ({t.micro_batch_size}) must be whole groups of "
                f"rollout.n_samples_per_prompt ({r.n_samples_per_prompt}): the engine samples "
                "each micro-batch's images as one batch and the trainer recomputes them so"
            )
        if EVAL_MODES.get(run.eval.mode).background:
            raise ValueError(
                f"eval.mode {run.eval.mode}: an image run evaluates on its own engine between "
                "steps (a mode that is not background)"
            )
        if run.sft is not None or run.agent.function is not None or t.distill is not None:
            raise ValueError(
                "sft, agent and train.distill are for text runs; an image run pretrains with "
                "diffusion.pretrain_steps"
            )
        if t.lora is not None or t.true_on_policy or r.precision != "none":
            raise ValueError(
                "train.lora, train.true_on_policy and rollout.precision are for text runs"
            )
