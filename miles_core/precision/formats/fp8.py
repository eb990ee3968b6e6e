"""`fp8` (E4M3, one float32 scale per tensor, `weight_scale`) and `fp8_block` (128×128 blocks,
`weight_scale_inv`): SGLang's `fp8` quantization method (precision/fp8.py has the formula)."""

from __future__ import annotations

from typing import Any

import torch

from miles_core.precision import fp8
from miles_core.precision.format import FORMATS, Parts, WeightFormat


def _config(ignore: list[str], **extra: Any) -> dict[str, Any]:
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        **extra,
        "modules_to_not_convert": ignore,
    }


def amax_or_zero(rows: torch.Tensor) -> torch.Tensor:
    """A float32 scalar: the amax of `rows` (0 when a rank holds none)."""
    return rows.float().abs().amax() if rows.numel() else torch.zeros((), dtype=torch.float32)


@FORMATS.register("fp8")
class FP8(WeightFormat):
    row_parts = frozenset({"weight"})

    def parts(self, shape):
        return {"weight": (tuple(shape), fp8.E4M3), "weight_scale": ((1,), torch.float32)}

    def quantize(self, w, amax=None) -> Parts:
        q, s = fp8.quantize_per_tensor(w)
        return {"weight": q, "weight_scale": s}

    def dequantize(self, parts: Parts) -> torch.Tensor:
        return fp8.dequantize_per_tensor(parts["weight"], parts["weight_scale"])

    def stats(self, rows, start, shape):
        return amax_or_zero(rows)

    def quantize_rows(self, rows, start, shape, stats) -> Parts:
        q, s = fp8.quantize_per_tensor(rows, stats)
        return {"weight": q, "weight_scale": s}

    def quantization_config(self, ignore):
        return _config(ignore)


@FORMATS.register("fp8_block")
class FP8Block(WeightFormat):
    row_parts = frozenset({"weight"})

    def parts(self, shape):
        n, k = shape
        blocks = (-(-n // fp8.BLOCK), -(-k // fp8.BLOCK))
        return {"weight": (tuple(shape), fp8.E4M3), "weight_scale_inv": (blocks, torch.float32)}

    def quantize(self, w, amax=None) -> Parts:
        q, s = fp8.quantize_block(w)
        return {"weight": q, "weight_scale_inv": s}

    def dequantize(self, parts: Parts) -> torch.Tensor:
        return fp8.dequantize_block(parts["weight"], parts["weight_scale_inv"])

    def stats(self, rows, start, shape):
        return fp8.block_amax(rows, start, shape)

    def quantize_rows(self, rows, start, shape, stats) -> Parts:
        q, s = fp8.quantize_block_rows(rows, start, stats)
        return {"weight": q, "weight_scale_inv": s}

    def quantization_config(self, ignore):
        return _config(ignore, weight_block_size=[fp8.BLOCK, fp8.BLOCK])
