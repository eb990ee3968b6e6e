"""MX formats (OCP MX v1.0): elements in 1×32 blocks along the last dim, one E8M0 scale per
block, computed by RCEIL (TransformerEngine's `MXFP8Quantizer`, rowwise) or FLOOR.

MXFP8, E4M3 elements:

    e = rceil(amax / 448)   |   floor: e = exponent(amax) − 8
    X = 2^(e − 127)
    q = clamp(x / X, -448, 448) → e4m3;  x ≈ q · X

MXFP4, E2M1 elements (`fp4.py`), the same with 6 and 2 (the largest E2M1 power of two is 4);
the codes packed two per byte, uint8 [..., K/2].

Scales are stored compact and unswizzled, uint8 [N, K/32] (`weight_scale_inv` in a checkpoint);
a kernel that wants swizzled tiles swizzles them itself. A last dim not divisible by 32 is
refused, not padded.
"""

from __future__ import annotations

from typing import Literal

import torch

from miles_core.precision import e8m0, fp4
from miles_core.precision.blocks import last_dim_blocks
from miles_core.precision.fp8 import E4M3_MAX, cast_e4m3

BLOCK = 32
E4M3_EMAX = 8  # 256, the largest power of two in E4M3
E2M1_EMAX = 2  # 4, the largest power of two in E2M1

ScaleRule = Literal["rceil", "floor"]


def _blocks(w: torch.Tensor) -> torch.Tensor:
    return last_dim_blocks(w, BLOCK, "MX formats")


def scale_bytes(
    amax: torch.Tensor,
    rule: ScaleRule = "rceil",
    max_elem: float = E4M3_MAX,
    emax: int = E4M3_EMAX,
) -> torch.Tensor:
    """The E8M0 byte of each block from its amax, for elements of largest value `max_elem`
    and largest power of two 2^`emax`."""
    if rule == "rceil":
        return e8m0.rceil(amax, max_elem)
    if rule == "floor":
        return e8m0.floor(amax, emax)
    raise ValueError(f"unknown MX scale rule {rule!r}: rceil or floor")


def quantize_mxfp8(w: torch.Tensor, rule: ScaleRule = "rceil") -> tuple[torch.Tensor, torch.Tensor]:
    """(q e4m3 like `w`, scales uint8 [..., K/32])."""
    blocks = _blocks(w)
    e = scale_bytes(blocks.abs().amax(-1), rule)
    q = cast_e4m3(blocks / e8m0.value(e).unsqueeze(-1))
    return q.reshape(w.shape), e


def dequantize_mxfp8(q: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    blocks = q.float().reshape(*q.shape[:-1], -1, BLOCK)
    return (blocks * e8m0.value(e).unsqueeze(-1)).reshape(q.shape)


def quantize_mxfp4(w: torch.Tensor, rule: ScaleRule = "rceil") -> tuple[torch.Tensor, torch.Tensor]:
    """(packed E2M1 codes uint8 [..., K/2], scales uint8 [..., K/32])."""
    blocks = _blocks(w)
    e = scale_bytes(blocks.abs().amax(-1), rule, fp4.E2M1_MAX, E2M1_EMAX)
    codes = fp4.encode(blocks / e8m0.value(e).unsqueeze(-1))
    return fp4.pack(codes.reshape(w.shape)), e


def dequantize_mxfp4(packed: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    values = fp4.decode(fp4.unpack(packed))
    blocks = values.reshape(*values.shape[:-1], -1, BLOCK)
    return (blocks * e8m0.value(e).unsqueeze(-1)).reshape(values.shape)
