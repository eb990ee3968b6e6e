"""Blocks of consecutive elements along the last dim: the unit MX, NVFP4 and INT4 scale over."""

from __future__ import annotations

import torch


def last_dim_blocks(w: torch.Tensor, size: int, what: str) -> torch.Tensor:
    """`w` as float32 [..., K / size, size]; a last dim `size` does not divide is refused."""
    if size <= 0 or w.dim() < 1 or w.shape[-1] % size:
        raise ValueError(
            f"{what} blocks the last dim by {size}: shape {tuple(w.shape)} does not divide"
        )
    return w.float().reshape(*w.shape[:-1], w.shape[-1] // size, size)
