"""Runs torchao 0.18's eager `to_mx` (pure PyTorch on CPU) over given inputs, in its own process:
`python tests/torchao_mx_oracle.py IN.pt OUT.pt`. IN holds {case: tensor}; OUT gets
{(case, elem, mode): (scale bytes, data bytes)} as flat lists for E4M3 and E2M1 elements, RCEIL and FLOOR.
torchao is installed outside the venv (Makefile: .venv/torchao), on this process's path only."""

import logging
import sys
import warnings

import torch

logging.disable(logging.WARNING)  # its CUDA extensions do not load on CPU
warnings.simplefilter("ignore")
from torchao.prototype.mx_formats.config import ScaleCalculationMode  # noqa: E402
from torchao.prototype.mx_formats.mx_tensor import to_mx  # noqa: E402

ELEMENTS = {"e4m3": torch.float8_e4m3fn, "e2m1": torch.float4_e2m1fn_x2}
MODES = {"rceil": ScaleCalculationMode.RCEIL, "floor": ScaleCalculationMode.FLOOR}


def _flat(t: torch.Tensor) -> list[int]:
    return t.view(torch.uint8).flatten().tolist()


inputs = torch.load(sys.argv[1])
out = {}
for case, x in inputs.items():
    for elem, dtype in ELEMENTS.items():
        for mode, m in MODES.items():
            scale, data = to_mx(x, dtype, 32, m)
            out[(case, elem, mode)] = (_flat(scale), _flat(data))
torch.save(out, sys.argv[2])
