"""The optimizer every trainer backend uses (fused AdamW from the run's optim settings) and its
learning-rate schedule: linear warmup, then constant, cosine or linear decay to min_lr."""

from __future__ import annotations

import math

import torch


def lr_lambda(step: int, lr: float, min_lr: float, warmup: int, total: int, style: str) -> float:
    if warmup and step < warmup:
        return (step + 1) / warmup
    if style == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    floor = min_lr / lr
    if style == "cosine":
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    if style == "linear":
        return floor + (1 - floor) * (1 - progress)
    raise ValueError(f"unknown lr_decay_style {style!r}")


def build_scheduler(optimizer, lr: float, min_lr: float, warmup: int, total: int, style: str):
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_lambda(s, lr, min_lr, warmup, total, style)
    )


def build_optimizer(params, optim: dict, total_steps: int):
    """(AdamW over `params`, its LR schedule) from a config section's optim settings (lr,
    min_lr, warmup, decay style, betas, weight decay; `offload`: its state kept in host memory
    or on disk between steps, `train/optimizer_offload.py`)."""
    from miles_core.train.optimizer_offload import OffloadedAdamW, make_store, offload_settings

    kwargs = dict(
        lr=optim["lr"],
        betas=(optim["adam_beta1"], optim["adam_beta2"]),
        weight_decay=optim["weight_decay"],
        eps=1e-8,
        fused=True,  # one kernel over all parameters: 5x the for-loop's speed on CPU
    )
    offload = offload_settings(optim)
    if offload["optimizer"] == "none":
        optimizer = torch.optim.AdamW(params, **kwargs)
    else:
        bucket_numel = int(offload.get("bucket_mb", 256) * (1 << 20)) // 4  # fp32 elements
        optimizer = OffloadedAdamW(
            params, store=make_store(offload), bucket_numel=bucket_numel, **kwargs
        )
    scheduler = build_scheduler(
        optimizer,
        optim["lr"],
        optim["min_lr"],
        optim["lr_warmup_steps"],
        total_steps,
        optim["lr_decay_style"],
    )
    return optimizer, scheduler
