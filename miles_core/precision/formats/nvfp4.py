"""`nvfp4`: E2M1 elements packed two per byte (`weight`), an E4M3 scale per 1×16 block
(`weight_scale`) and the float32 tensor scale (`weight_scale_2`); gate and up share one global
amax. The checkpoint is ModelOpt's (SGLang: modelopt_fp4), with `hf_quant_config.json`
(precision/nvfp4.py has TransformerEngine's formula)."""

from __future__ import annotations

import torch

from miles_core.precision import fp8, nvfp4
from miles_core.precision.format import FORMATS, Parts, WeightFormat
from miles_core.precision.formats.fp8 import amax_or_zero
from miles_core.precision.formats.mxfp8 import block_refuses


@FORMATS.register("nvfp4")
class NVFP4(WeightFormat):
    shares_amax = True
    row_parts = frozenset({"weight", "weight_scale"})

    def refuses(self, shape):
        return block_refuses(shape, nvfp4.BLOCK)

    def parts(self, shape):
        n, k = shape
        return {
            "weight": ((n, k // 2), torch.uint8),
            "weight_scale": ((n, k // nvfp4.BLOCK), fp8.E4M3),
            "weight_scale_2": ((), torch.float32),
        }

    def quantize(self, w, amax=None) -> Parts:
        packed, s8, g_dec = nvfp4.quantize(w, amax)
        return {"weight": packed, "weight_scale": s8, "weight_scale_2": g_dec}

    def dequantize(self, parts: Parts) -> torch.Tensor:
        return nvfp4.dequantize(parts["weight"], parts["weight_scale"], parts["weight_scale_2"])

    def stats(self, rows, start, shape):
        return amax_or_zero(rows)

    def quantize_rows(self, rows, start, shape, stats) -> Parts:
        return self.quantize(rows, stats)

    def quantization_config(self, ignore):
        return {
            "quant_method": "modelopt",
            "quant_algo": "NVFP4",
            "group_size": nvfp4.BLOCK,
            "ignore": ignore,
            "kv_cache_scheme": None,
        }

    def side_files(self, ignore):
        return {
            "hf_quant_config.json": {
                "producer": {"name": "modelopt"},
                "quantization": {
                    "quant_algo": "NVFP4",
                    "kv_cache_quant_algo": None,
                    "group_size": nvfp4.BLOCK,
                    "exclude_modules": ignore,
                },
            }
        }

    def checkpoint_only(self, shape):
        return {"input_scale": torch.ones((), dtype=torch.float32)}
