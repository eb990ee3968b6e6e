"""INT4 group-wise symmetric quantization, the fake-quant of INT4 QAT and the W4A16 weights a
rollout serves. Per group of G consecutive elements along the input (last) dim:

    s = max(max|w| / 7, 1e-5)          (float32; a true division)
    q = clamp(round(w / s), -7, 7)     (round half to even; level -8 is never produced)
    w ≈ q · s

QAT's forward uses q · s with a straight-through gradient (`formats.fake_quantize`). Storage is compressed-tensors' `pack-quantized`: q + 8 (1..15) as nibbles, eight
per int32, nibble j at bits 4j..4j+3 (`weight_packed` [N, K/8]), with `weight_scale` [N, K/G]
and `weight_shape` int32 [2].
"""

from __future__ import annotations

import torch

from miles_core.precision.blocks import last_dim_blocks

QMAX = 7
EPS = 1e-5
PER_INT32 = 8


def _groups(w: torch.Tensor, group: int) -> torch.Tensor:
    return last_dim_blocks(w, group, "INT4")


def quantize(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 in [-7, 7] like `w`, scales float32 [..., K/G])."""
    g = _groups(w, group)
    s = (g.abs().amax(-1) / QMAX).clamp(min=EPS)
    q = torch.round(g / s.unsqueeze(-1)).clamp(-QMAX, QMAX)
    return q.to(torch.int8).reshape(w.shape), s


def dequantize(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    g = q.float().reshape(*q.shape[:-1], s.shape[-1], -1)
    return (g * s.unsqueeze(-1)).reshape(q.shape)


def pack(q: torch.Tensor) -> torch.Tensor:
    """int8 q [..., K] (K divisible by 8) → int32 [..., K/8], q + 8 per nibble."""
    if q.shape[-1] % PER_INT32:
        raise ValueError(f"INT4 packs {PER_INT32} values per int32: last dim {q.shape[-1]}")
    nib = (q.to(torch.int64) + 8).reshape(*q.shape[:-1], -1, PER_INT32)
    shifts = torch.arange(0, 4 * PER_INT32, 4, dtype=torch.int64)
    word = (nib << shifts).sum(-1)
    return torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., K/8] → int8 q [..., K]."""
    word = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(0, 4 * PER_INT32, 4, dtype=torch.int64)
    nib = (word.unsqueeze(-1) >> shifts) & 0xF
    return (nib - 8).to(torch.int8).flatten(-2)
