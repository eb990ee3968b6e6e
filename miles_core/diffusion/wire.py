"""The image engine's rollout request and response, shaped like sglang-diffusion's rollout API.

A request names its prompts, how many images each prompt gets, the sampler (`rollout_sde_type`
and `rollout_noise_level` η; `rollout: false` is an evaluation: the deterministic ODE), the
steps, the guidance and a seed. A rollout's response carries, per image in prompt-major order,
the trajectory the trainer scores again: the latents at every sigma and each step's log-prob.
Arrays travel as the raw little-endian bytes of float32 tensors, base64-encoded, with their
shape (exact: a recomputed log-prob is compared bit for bit).

`RolloutRequest` checks what it can alone (steps ≥ 1, η ≥ 0, sizes within bounds); the engine
checks the rest against its model (`check_for`): the words against its vocabulary, the
resolution against its image size.
"""

from __future__ import annotations

import base64
import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_PROMPTS = 256
MAX_IMAGES = 1024  # prompts × outputs per prompt in one request
MAX_STEPS = 200
MAX_GUIDANCE = 100.0
# images × (steps + 1) in one request: the latents a rollout returns (24×24: 113 MB of float32)
MAX_IMAGE_STEPS = 16384
SDE_TYPES = ("sde", "ode")


class RolloutRequest(BaseModel):
    """`POST /rollout/generate`."""

    model_config = ConfigDict(extra="forbid")

    prompt: list[str] = Field(min_length=1, max_length=MAX_PROMPTS)
    num_outputs_per_prompt: int = Field(1, ge=1, le=MAX_IMAGES)
    num_inference_steps: int = Field(10, ge=1, le=MAX_STEPS)
    # classifier-free guidance w (None: the conditional velocity alone)
    guidance_scale: float | None = Field(None, ge=0, le=MAX_GUIDANCE)
    height: int | None = Field(None, ge=1, le=4096)  # None: the model's image size
    width: int | None = Field(None, ge=1, le=4096)
    seed: int = Field(0, ge=0, lt=2**63)
    # True: sample the SDE and return the trajectory with its per-step log-probs (training);
    # False: an evaluation, the deterministic ODE, images only
    rollout: bool = True
    rollout_sde_type: Literal["sde", "ode"] = "sde"
    rollout_noise_level: float = Field(0.7, ge=0, le=10)
    rollout_return_dit_trajectory: bool = True
    return_images: bool = True

    @field_validator("guidance_scale", "rollout_noise_level")
    @classmethod
    def _finite(cls, value: float | None) -> float | None:
        if value is not None and not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> RolloutRequest:
        if len(self.prompt) * self.num_outputs_per_prompt > MAX_IMAGES:
            raise ValueError(
                f"{len(self.prompt)} prompts × {self.num_outputs_per_prompt} outputs is more "
                f"than {MAX_IMAGES} images in one request"
            )
        if self.images * (self.num_inference_steps + 1) > MAX_IMAGE_STEPS:
            raise ValueError(
                f"{self.images} images × {self.num_inference_steps + 1} latents each is more "
                f"than {MAX_IMAGE_STEPS} in one request: send fewer images or steps per request"
            )
        if self.rollout and self.eta == 0:
            raise ValueError(
                "a rollout (rollout: true) returns per-step log-probs, which need the SDE with "
                "rollout_noise_level > 0; send rollout: false for ODE samples"
            )
        return self

    @property
    def eta(self) -> float:
        """The SDE's noise level: 0 for the ODE (`rollout_sde_type: ode` or an evaluation)."""
        if not self.rollout or self.rollout_sde_type == "ode":
            return 0.0
        return self.rollout_noise_level

    @property
    def images(self) -> int:
        return len(self.prompt) * self.num_outputs_per_prompt

    def check_for(self, image_size: int, encode) -> torch.Tensor:
        """The prompts' word ids, one row per image (prompt-major), once the request fits the
        model: `encode(prompts)` raises ValueError for a word outside its vocabulary."""
        for name, value in (("height", self.height), ("width", self.width)):
            if value is not None and value != image_size:
                raise ValueError(
                    f"{name} {value}: this model makes {image_size}×{image_size} images only"
                )
        ids = encode(self.prompt)
        return ids.repeat_interleave(self.num_outputs_per_prompt, dim=0)


def encode_array(tensor: torch.Tensor) -> dict:
    """A float32 tensor as {shape, dtype, data}: its little-endian bytes in base64."""
    array = tensor.detach().to(torch.float32).contiguous().numpy().astype("<f4", copy=False)
    return {
        "shape": list(array.shape),
        "dtype": "float32",
        "data": base64.b64encode(array.tobytes()).decode(),
    }


def decode_array(data: dict) -> torch.Tensor:
    """The tensor `encode_array` wrote, bit for bit."""
    shape = [int(d) for d in data["shape"]]
    if data.get("dtype") != "float32":
        raise ValueError(f"arrays travel as float32; got {data.get('dtype')!r}")
    raw = base64.b64decode(data["data"], validate=True)
    if len(raw) != 4 * math.prod(shape):
        raise ValueError(
            f"array of shape {shape} needs {4 * math.prod(shape)} bytes; got {len(raw)}"
        )
    return torch.from_numpy(np.frombuffer(raw, dtype="<f4").reshape(shape).astype(np.float32))


@dataclass
class RolloutOutput:
    """An engine's answer: `images` float32 [N, 3, S, S] in [-1, 1] (N = prompts × outputs,
    prompt-major; None if not asked), and for a rollout the trajectory: `latents` [N, steps + 1,
    3, S, S], `sigmas` [steps + 1], `log_probs` [N, steps]; `weight_version` that sampled it."""

    images: torch.Tensor | None
    latents: torch.Tensor | None
    sigmas: torch.Tensor
    log_probs: torch.Tensor | None
    weight_version: int

    def to_json(self) -> dict:
        out: dict = {
            "weight_version": str(self.weight_version),
            "sigmas": encode_array(self.sigmas),
        }
        for name in ("images", "latents", "log_probs"):
            value = getattr(self, name)
            if value is not None:
                out[name] = encode_array(value)
        return out

    @classmethod
    def from_json(cls, data: dict) -> RolloutOutput:
        def get(name: str) -> torch.Tensor | None:
            return decode_array(data[name]) if data.get(name) is not None else None

        return cls(
            images=get("images"),
            latents=get("latents"),
            sigmas=decode_array(data["sigmas"]),
            log_probs=get("log_probs"),
            weight_version=int(data["weight_version"]),
        )
