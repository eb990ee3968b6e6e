"""NVFP4: E2M1 elements in 1×16 blocks along the last dim, an E4M3 scale per block and one
float32 scale per tensor; TransformerEngine's reference quantizer (no 4over6, no Hadamard
transform, no stochastic rounding), so its bytes are the ones TE, FlashInfer and SGLang read:

    A     = amax of the tensor (float32; gate and up: of the pair, `quantize_pair`)
    G_enc = min(448 · 6 / A, FLT_MAX), 1 when that is 0;   G_dec = 1 / G_enc
    S8    = clamp(min(b_amax · (G_enc · (1/6)), FLT_MAX), ±448) → e4m3      (per block)
    e     = min(1 / (float(S8) · G_dec), FLT_MAX)
    q     = fp4(clamp(x · e, ±6));  x ≈ q · float(S8) · G_dec

An all-zero block gets S8 = 0, e = FLT_MAX and stays 0. A checkpoint stores q packed
(`weight`, uint8 [N, K/2]), S8 (`weight_scale`, e4m3 [N, K/16]) and G_dec (`weight_scale_2`,
float32 scalar).
"""

from __future__ import annotations

import torch

from miles_core.precision import fp4
from miles_core.precision.blocks import last_dim_blocks
from miles_core.precision.fp8 import E4M3, E4M3_MAX

BLOCK = 16
FLT_MAX = torch.finfo(torch.float32).max


def global_decode_scale(amax: torch.Tensor) -> torch.Tensor:
    """G_dec = 1 / G_enc of a tensor amax (float32 scalar)."""
    return 1.0 / _global_encode_scale(amax.float())


def _global_encode_scale(amax: torch.Tensor) -> torch.Tensor:
    enc = torch.clamp(E4M3_MAX * fp4.E2M1_MAX / amax, max=FLT_MAX)
    return torch.where(enc == 0, torch.ones_like(enc), enc)


def _blocks(w: torch.Tensor) -> torch.Tensor:
    return last_dim_blocks(w, BLOCK, "NVFP4")


def quantize(
    w: torch.Tensor, amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed codes uint8 [..., K/2], block scales e4m3 [..., K/16], G_dec float32 []);
    `amax`: the global amax to use (a gate/up pair's), else `w`'s own."""
    blocks = _blocks(w)
    a = blocks.abs().amax() if amax is None else amax.float().reshape(())
    g_enc = _global_encode_scale(a)
    g_dec = 1.0 / g_enc
    s = torch.clamp(blocks.abs().amax(-1) * (g_enc * (1.0 / fp4.E2M1_MAX)), max=FLT_MAX)
    s8 = s.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    enc = torch.clamp(1.0 / (s8.float() * g_dec), max=FLT_MAX)
    y = (blocks * enc.unsqueeze(-1)).clamp(-fp4.E2M1_MAX, fp4.E2M1_MAX)
    return fp4.pack(fp4.encode(y).reshape(w.shape)), s8, g_dec


def quantize_pair(
    gate: torch.Tensor, up: torch.Tensor
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Gate and up quantized with one global amax (that of both), so a fused gate_up GEMM
    has a single outer scale: their `weight_scale_2` are equal."""
    amax = torch.maximum(gate.float().abs().amax(), up.float().abs().amax())
    return quantize(gate, amax), quantize(up, amax)


def dequantize(packed: torch.Tensor, s8: torch.Tensor, g_dec: torch.Tensor) -> torch.Tensor:
    values = fp4.decode(fp4.unpack(packed))
    blocks = values.reshape(*values.shape[:-1], -1, BLOCK)
    return (blocks * (s8.float() * g_dec.float()).unsqueeze(-1)).reshape(values.shape)
