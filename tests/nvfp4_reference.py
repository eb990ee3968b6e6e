"""TransformerEngine's NVFP4 reference quantizer (`NVFP4QuantizerRef._quantize_blockwise_reference`,
1×16 tiles, pow2 off, no 4over6), ported operation by operation as an independent oracle for
`miles_core.precision.nvfp4`: its own FP4 cast by value ranges, its own packing, its own
scale arithmetic. Kept out of miles_core on purpose: it must not share code with what it checks."""

from __future__ import annotations

import torch

_FLT_MAX = torch.finfo(torch.float32).max


def _cast_to_fp4x2(x: torch.Tensor) -> torch.Tensor:
    r = torch.zeros_like(x, dtype=torch.uint8)
    ranges = [
        ((x >= 0.0) & (x <= 0.25), 0),
        ((x > 0.25) & (x < 0.75), 1),
        ((x >= 0.75) & (x <= 1.25), 2),
        ((x > 1.25) & (x < 1.75), 3),
        ((x >= 1.75) & (x <= 2.5), 4),
        ((x > 2.5) & (x < 3.5), 5),
        ((x >= 3.5) & (x <= 5.0), 6),
        (x > 5.0, 7),
        ((x >= -0.25) & (x < -0.0), 8),
        ((x < -0.25) & (x > -0.75), 9),
        ((x <= -0.75) & (x >= -1.25), 10),
        ((x < -1.25) & (x > -1.75), 11),
        ((x <= -1.75) & (x >= -2.5), 12),
        ((x < -2.5) & (x > -3.5), 13),
        ((x <= -3.5) & (x >= -5.0), 14),
        (x < -5.0, 15),
    ]
    for mask, code in ranges:
        r[mask] = code
    return r[:, ::2] + r[:, 1::2] * 16


def quantize(x: torch.Tensor, global_amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8 [m, n/2], e4m3 block scales [m, n/16]) of a 2-D `x`."""
    m, n = x.shape
    xb = x.view(m, n // 16, 16)
    vec_max = torch.amax(torch.abs(xb), dim=-1, keepdim=True).to(torch.float32)
    six = torch.tensor(6.0)
    e4m3_max = torch.tensor(448.0)
    g_enc = torch.div(e4m3_max * six, global_amax.to(torch.float32))
    g_enc = torch.min(g_enc, torch.tensor(_FLT_MAX))
    if g_enc == torch.tensor(0.0):
        g_enc = torch.tensor(1.0)
    g_dec = torch.div(1.0, g_enc)
    scale = vec_max * (g_enc * torch.reciprocal(six))
    scale = torch.min(scale, torch.tensor(_FLT_MAX))
    scale = torch.clamp(scale, min=-e4m3_max, max=e4m3_max).to(torch.float8_e4m3fn)
    enc = torch.min(torch.div(1.0, scale.to(torch.float32) * g_dec), torch.tensor(_FLT_MAX))
    clipped = torch.clamp(xb.to(torch.float32) * enc, -six, six).reshape(m, n)
    return _cast_to_fp4x2(clipped), scale.squeeze(-1)
