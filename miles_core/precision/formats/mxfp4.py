"""`mxfp4`: E2M1 elements packed two per byte (`weight`, uint8 [N, K/2]) and one E8M0 scale per
1×32 block (`weight_scale`, uint8 [N, K/32]) (precision/mx.py)."""

from __future__ import annotations

import torch

from miles_core.precision import mx
from miles_core.precision.format import FORMATS, Parts, WeightFormat
from miles_core.precision.formats.mxfp8 import MXOptions, block_refuses


@FORMATS.register("mxfp4")
class MXFP4(WeightFormat):
    Options = MXOptions
    row_parts = frozenset({"weight", "weight_scale"})

    def refuses(self, shape):
        return block_refuses(shape, mx.BLOCK)

    def parts(self, shape):
        n, k = shape
        return {
            "weight": ((n, k // 2), torch.uint8),
            "weight_scale": ((n, k // mx.BLOCK), torch.uint8),
        }

    def quantize(self, w, amax=None) -> Parts:
        packed, e = mx.quantize_mxfp4(w, self.options.scale_rule)
        return {"weight": packed, "weight_scale": e}

    def dequantize(self, parts: Parts) -> torch.Tensor:
        return mx.dequantize_mxfp4(parts["weight"], parts["weight_scale"])

    def quantization_config(self, ignore):
        return {"quant_method": "mxfp4", "modules_to_not_convert": ignore}
