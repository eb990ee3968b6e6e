"""E8M0 scales (`torch.float8_e8m0fnu`, OCP MX): a byte e stands for 2^(e − 127), e in 0..254;
255 is NaN; there is no zero. Exponents are computed from float32 bits with integer operations,
never with `log2` (a float log2 of 2^k·(1 + 2^-23) rounds to k and loses the step RCEIL takes).

- RCEIL (TransformerEngine, cuBLAS, Blackwell): e = the biased exponent of v = amax / max_elem,
  plus one when any mantissa bit of v is set: the smallest power of two ≥ v. amax 0 → byte 0.
- FLOOR (OCP's default): e = the biased exponent of amax minus emax_elem (the exponent of the
  element format's largest power of two: 8 for E4M3, 2 for E2M1); an amax above
  2^emax · max_elem then saturates its largest elements.
"""

from __future__ import annotations

import torch

NAN_BYTE = 255
_MANTISSA = (1 << 23) - 1


def _bits(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(biased exponent, mantissa) of float32 values, as int32."""
    b = v.float().contiguous().view(torch.int32)
    return (b >> 23) & 0xFF, b & _MANTISSA


def rceil(amax: torch.Tensor, max_elem: float) -> torch.Tensor:
    """uint8 E8M0 bytes: the smallest power of two ≥ amax / max_elem (float32 division)."""
    v = amax.float() / max_elem
    exp, mant = _bits(v)
    e = exp + (mant != 0).to(torch.int32)
    e = torch.where(v == 0, torch.zeros_like(e), e.clamp(max=254))
    e = torch.where(v.isnan(), torch.full_like(e, NAN_BYTE), e)  # inf saturates to 254
    return e.to(torch.uint8)


def floor(amax: torch.Tensor, emax_elem: int) -> torch.Tensor:
    """uint8 E8M0 bytes: 2^(floor(log2 amax) − emax_elem), clamped to [0, 254]."""
    exp, _ = _bits(amax)
    e = (exp - emax_elem).clamp(0, 254)
    e = torch.where(amax.float() == 0, torch.zeros_like(e), e)
    e = torch.where(amax.float().isnan(), torch.full_like(e, NAN_BYTE), e)
    return e.to(torch.uint8)


def value(e: torch.Tensor) -> torch.Tensor:
    """The float32 power of two 2^(e − 127) of E8M0 bytes (byte 0: the subnormal 2^-127)."""
    e = e.to(torch.int32)
    normal = (e.clamp(min=1) << 23).view(torch.float32)
    out = torch.where(e == 0, torch.full_like(normal, 2.0**-127), normal)
    return torch.where(e == NAN_BYTE, torch.full_like(out, float("nan")), out)
