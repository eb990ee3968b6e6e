"""Flow-matching pretraining of the image model (the SFT stage before Flow-GRPO), and its
evaluation by the checker.

Each step draws training scenes (`split_scenes()[0]`), renders them on the fly from a seeded
stream, noises them to `x_σ = (1 − σ)·x0 + σ·ε` with σ drawn logit-normally (σ = sigmoid(n),
n ~ N(0, 1), as SD3 trains; it favours the middle noise levels where the composition is
decided; uniform σ did no better), and regresses the velocity: loss = MSE(v_pred, ε − x0). A
tenth of the prompts are dropped to the null prompt so that classifier-free guidance has an
unconditional branch. AdamW with a linear warmup, then a cosine decay to a tenth of the peak
learning rate at the last step, and gradients clipped to norm 1.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from miles_core.diffusion.checker import SCORES, check
from miles_core.diffusion.model import (
    PRESETS,
    ImageModel,
    build_image_model,
    load_image_model,
    save_image_model,
)
from miles_core.diffusion.render import render_batch
from miles_core.diffusion.scenes import Scene, split_scenes
from miles_core.diffusion.sde import sample

PROMPT_DROPOUT = 0.1  # the share of prompts trained as the null prompt
WARMUP_STEPS = 50  # the learning rate rises linearly over these steps,
FINAL_LR_FRACTION = 0.1  # then falls along a cosine to this fraction of `lr` at the last step
GRAD_CLIP = 1.0


def flow_matching_batch(
    model: ImageModel, scenes: Sequence[Scene], seed: int, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """One training batch: the rendered images `x0`, noise `eps`, noise levels `sigma`, the
    noised `x_t`, the target velocity, the prompts' ids and the prompt-dropout mask `null`."""
    x0 = torch.from_numpy(render_batch(list(scenes), model.image_size, seed))
    batch = x0.shape[0]
    eps = torch.randn(x0.shape, generator=generator)
    sigma = torch.sigmoid(torch.randn(batch, generator=generator))
    null = torch.rand(batch, generator=generator) < PROMPT_DROPOUT
    s = sigma[:, None, None, None]
    return {
        "x0": x0,
        "eps": eps,
        "sigma": sigma,
        "x_t": (1 - s) * x0 + s * eps,
        "target": eps - x0,
        "prompt_ids": model.encode([scene.prompt for scene in scenes]),
        "null": null,
    }


def flow_matching_loss(model: ImageModel, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The batch's mean squared error between predicted and target velocity."""
    v = model(batch["x_t"], batch["sigma"], batch["prompt_ids"], batch["null"])
    return torch.nn.functional.mse_loss(v, batch["target"])


def lr_factor(step: int, steps: int) -> float:
    """The learning rate of step `step` (0-based) of `steps`, as a fraction of the peak."""
    if step < WARMUP_STEPS:
        return (step + 1) / WARMUP_STEPS
    progress = (step - WARMUP_STEPS) / max(1, steps - 1 - WARMUP_STEPS)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return FINAL_LR_FRACTION + (1 - FINAL_LR_FRACTION) * cosine


def pretrain(
    preset_or_dir: str | Path,
    out_dir: str | Path,
    steps: int,
    batch_size: int = 32,
    lr: float = 2e-3,
    seed: int = 0,
    size: int | None = None,
    callback: Callable[[int, ImageModel, float], None] | None = None,
) -> Path:
    """Pretrains a new model of a preset (or continues a saved one) for `steps` AdamW steps on
    the training scenes and saves it to `out_dir`, which it returns. `size` is the image size,
    which must be the model's (None: the model's). `callback(step, model, loss)` runs after
    every step (for logs and intermediate evaluations)."""
    if str(preset_or_dir) in PRESETS:
        model = build_image_model(str(preset_or_dir), seed)
    else:
        model = load_image_model(preset_or_dir)
    if size is not None and size != model.image_size:
        raise ValueError(
            f"the model makes {model.image_size}px images; pass size={model.image_size} or None"
        )
    train_scenes, _ = split_scenes()
    rng = np.random.default_rng(seed)
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, steps))
    model.train()
    for step in range(1, steps + 1):
        chosen = [train_scenes[i] for i in rng.integers(len(train_scenes), size=batch_size)]
        batch = flow_matching_batch(model, chosen, int(rng.integers(2**31)), generator)
        loss = flow_matching_loss(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
        schedule.step()
        if callback is not None:
            callback(step, model, float(loss.detach()))
    model.eval()
    return save_image_model(model, out_dir)


def evaluate(
    model: ImageModel,
    scenes: Sequence[Scene],
    samples_per_scene: int = 4,
    steps: int = 10,
    guidance: float | None = 3.0,
    seed: int = 0,
    batch_size: int = 128,
) -> dict[str, float]:
    """The checker's mean score per attribute (`colour`, `count`, `shape`, `position`, `all`,
    `reward`) over `samples_per_scene` ODE samples (η = 0, `steps` steps) of every scene, plus
    `samples` and the sampling wall time `seconds`."""
    was_training = model.training
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    todo = [scene for scene in scenes for _ in range(samples_per_scene)]
    totals = dict.fromkeys(SCORES, 0.0)
    start = time.perf_counter()
    for at in range(0, len(todo), batch_size):
        chunk = todo[at : at + batch_size]
        ids = model.encode([scene.prompt for scene in chunk])
        images, _ = sample(model, ids, steps, 0.0, guidance, generator)
        for image, scene in zip(images.numpy(), chunk, strict=True):
            for name, value in check(image, scene).items():
                totals[name] += value
    model.train(was_training)
    result = {name: total / max(1, len(todo)) for name, total in totals.items()}
    return {**result, "samples": len(todo), "seconds": time.perf_counter() - start}
