"""FP8 E4M3 (`torch.float8_e4m3fn`: max ±448, no infinity) with float32 scales, per tensor and in
128×128 blocks, by one formula:

    s = max(amax, EPS) / 448          (float32; amax over the tensor or the block)
    q = clamp(x / s, -448, 448) → e4m3 (round to nearest, ties to even)
    x ≈ q · s                          (s is the dequantisation multiplier)

`x / s` is a true division, never `x · (1/s)`, which can differ by one ulp and flip a rounding
tie; the clamp comes before every cast (an eager cast of a finite overflow need not saturate);
`EPS` keeps an all-zero block at 0 instead of 0/0. A block checkpoint stores `s` as
`weight_scale_inv` (DeepSeek's name for this multiplier), a per-tensor one as `weight_scale`.
"""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
EPS = 1e-12  # the smallest amax a scale is computed from
BLOCK = 128


def cast_e4m3(x: torch.Tensor) -> torch.Tensor:
    """float32 values to E4M3, saturating at ±448 (NaN stays NaN)."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def _scale(amax: torch.Tensor) -> torch.Tensor:
    return amax.float().clamp(min=EPS) / E4M3_MAX


def quantize_per_tensor(
    w: torch.Tensor, amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q e4m3 like `w`, s float32 [1]); `amax`: the whole tensor's, when `w` is a part of it."""
    a = w.float().abs().amax() if amax is None else amax.float()
    s = _scale(a).reshape(1)
    return cast_e4m3(w.float() / s), s


def dequantize_per_tensor(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return q.float() * s


def _blocks(w: torch.Tensor, block: int) -> tuple[torch.Tensor, int, int]:
    """w [N, K] zero-padded to multiples of `block`, viewed [N/b, b, K/b, b]."""
    if w.dim() != 2:
        raise ValueError(f"block FP8 takes a 2-D weight, not shape {tuple(w.shape)}")
    n, k = w.shape
    padded = torch.nn.functional.pad(w.float(), (0, -k % block, 0, -n % block))
    rows, cols = padded.shape[0] // block, padded.shape[1] // block
    return padded.view(rows, block, cols, block), n, k


def block_amax(
    rows: torch.Tensor, start: int = 0, shape: tuple[int, int] | None = None, block: int = BLOCK
) -> torch.Tensor:
    """float32 [ceil(N/b), ceil(K/b)]: each b×b block's amax over `rows`, rows [start, …) of a
    weight of `shape` (default: `rows` is the whole weight; the other rows count as 0)."""
    n, k = shape or tuple(rows.shape)
    full = torch.zeros(n, k, dtype=torch.float32)
    full[start : start + rows.shape[0]] = rows.float()
    return _blocks(full, block)[0].abs().amax(dim=(1, 3))


def quantize_block_rows(
    rows: torch.Tensor, start: int, amax: torch.Tensor, block: int = BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [start, …) of a weight quantized with its blocks' amax (`block_amax` of the whole
    weight): (q e4m3 like `rows`, s float32 [ceil(N/b), ceil(K/b)])."""
    s = _scale(amax)
    per_element = s.repeat_interleave(block, 0).repeat_interleave(block, 1)
    per_row = per_element[start : start + rows.shape[0], : rows.shape[1]]
    return cast_e4m3(rows.float() / per_row), s


def quantize_block(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(q e4m3 [N, K], s float32 [ceil(N/b), ceil(K/b)]): one scale per b×b block, the last
    blocks of a side not divisible by b zero-padded (padding never raises an amax)."""
    if w.dim() != 2:
        raise ValueError(f"block FP8 takes a 2-D weight, not shape {tuple(w.shape)}")
    return quantize_block_rows(w, 0, block_amax(w, block=block), block)


def dequantize_block(q: torch.Tensor, s: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    n, k = q.shape
    full = s.repeat_interleave(block, 0).repeat_interleave(block, 1)[:n, :k]
    return q.float() * full
