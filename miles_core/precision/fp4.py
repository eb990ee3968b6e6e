"""FP4 E2M1 elements: magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6} as codes 0..7, bit 3 the sign
(8..15 the negatives, 8 = −0), two per byte: element 2i in the low nibble, 2i + 1 in the high.

Rounding is to nearest with ties to the even code, after saturating at ±6 (TransformerEngine's
reference thresholds: 0.25 → 0, 0.75 → 1, 1.25 → 1, 1.75 → 2, 2.5 → 2, 3.5 → 4, 5 → 4). A
negative value that rounds to 0 keeps its sign (code 8).
"""

from __future__ import annotations

import torch

E2M1_MAX = 6.0
GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# (threshold, tie goes up): a magnitude past each threshold moves one code up
_STEPS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True))
_STEPS += ((5.0, False),)


def encode(x: torch.Tensor) -> torch.Tensor:
    """float values → uint8 E2M1 codes (one per element, unpacked)."""
    x = x.float()
    a = x.abs().clamp(max=E2M1_MAX)
    code = torch.zeros(x.shape, dtype=torch.uint8)
    for threshold, tie_up in _STEPS:
        code += (a >= threshold if tie_up else a > threshold).to(torch.uint8)
    return code | ((x < 0).to(torch.uint8) << 3)


def decode(codes: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 codes → float32 values."""
    grid = torch.tensor(GRID, dtype=torch.float32)
    value = grid[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -value, value)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] codes (K even) → [..., K/2] bytes, element 2i in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"FP4 packs two elements per byte: last dim {codes.shape[-1]} is odd")
    pairs = codes.reshape(*codes.shape[:-1], -1, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] bytes → [..., K] codes."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)
