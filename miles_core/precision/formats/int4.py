"""`int4`: W4A16, group-wise symmetric INT4 in compressed-tensors' `pack-quantized` layout
(`weight_packed` int32 [N, K/8], `weight_scale` [N, K/G], `weight_shape`) (precision/int4.py)."""

from __future__ import annotations

import torch
from pydantic import Field

from miles_core.plugins import PluginOptions
from miles_core.precision import int4
from miles_core.precision.format import FORMATS, Parts, WeightFormat


class INT4Options(PluginOptions):
    group_size: int = Field(
        128, gt=0, description="elements per scale along the input dim (must divide it)"
    )


@FORMATS.register("int4")
class INT4(WeightFormat):
    Options = INT4Options
    row_parts = frozenset({"weight_packed", "weight_scale"})

    def refuses(self, shape):
        if len(shape) != 2:
            return f"a {len(shape)}-D tensor (the format quantizes 2-D linear weights)"
        g = self.options.group_size
        if shape[-1] % g:
            return (
                f"rollout.precision_options.group_size {g} does not divide its input dim "
                f"{shape[-1]}"
            )
        if shape[-1] % int4.PER_INT32:
            return f"input dim {shape[-1]} is not a multiple of {int4.PER_INT32}"
        return None

    def parts(self, shape):
        n, k = shape
        return {
            "weight_packed": ((n, k // int4.PER_INT32), torch.int32),
            "weight_scale": ((n, k // self.options.group_size), torch.float32),
            "weight_shape": ((2,), torch.int32),
        }

    def quantize(self, w, amax=None) -> Parts:
        q, s = int4.quantize(w, self.options.group_size)
        shape = torch.tensor(list(w.shape), dtype=torch.int32)
        return {"weight_packed": int4.pack(q), "weight_scale": s, "weight_shape": shape}

    def dequantize(self, parts: Parts) -> torch.Tensor:
        return int4.dequantize(int4.unpack(parts["weight_packed"]), parts["weight_scale"])

    def quantize_rows(self, rows, start, shape, stats) -> Parts:
        return {**self.quantize(rows), "weight_shape": torch.tensor(list(shape), dtype=torch.int32)}

    def quantization_config(self, ignore):
        return {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "quantization_status": "compressed",
            "kv_cache_scheme": None,
            "ignore": ignore,
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "input_activations": None,
                    "output_activations": None,
                    "weights": {
                        "num_bits": 4,
                        "type": "int",
                        "strategy": "group",
                        "group_size": self.options.group_size,
                        "symmetric": True,
                        "dynamic": False,
                        "observer": "minmax",
                    },
                }
            },
        }
