"""`mxfp8`: E4M3 elements, one E8M0 scale per 1×32 block (uint8 `weight_scale_inv`, compact,
unswizzled); scales by RCEIL (TransformerEngine, Blackwell) or FLOOR (precision/mx.py)."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from miles_core.plugins import PluginOptions
from miles_core.precision import fp8, mx
from miles_core.precision.format import FORMATS, Parts, WeightFormat


class MXOptions(PluginOptions):
    scale_rule: Literal["rceil", "floor"] = Field(
        "rceil",
        description="E8M0 scale of a block: rceil (the smallest power of two that fits its "
        "amax; TransformerEngine, cuBLAS) or floor (OCP's rule, may saturate)",
    )


def block_refuses(shape: tuple[int, ...], block: int) -> str | None:
    if len(shape) != 2:
        return f"a {len(shape)}-D tensor (the format quantizes 2-D linear weights)"
    if shape[-1] % block:
        return f"input dim {shape[-1]} is not a multiple of the {block}-element block"
    return None


@FORMATS.register("mxfp8")
class MXFP8(WeightFormat):
    Options = MXOptions
    row_parts = frozenset({"weight", "weight_scale_inv"})

    def refuses(self, shape):
        return block_refuses(shape, mx.BLOCK)

    def parts(self, shape):
        n, k = shape
        return {
            "weight": ((n, k), fp8.E4M3),
            "weight_scale_inv": ((n, k // mx.BLOCK), torch.uint8),
        }

    def quantize(self, w, amax=None) -> Parts:
        q, e = mx.quantize_mxfp8(w, self.options.scale_rule)
        return {"weight": q, "weight_scale_inv": e}

    def dequantize(self, parts: Parts) -> torch.Tensor:
        return mx.dequantize_mxfp8(parts["weight"], parts["weight_scale_inv"])

    def quantization_config(self, ignore):
        return {
            "quant_method": "mxfp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [1, mx.BLOCK],
            "scale_fmt": "ue8m0",
            "modules_to_not_convert": ignore,
        }
