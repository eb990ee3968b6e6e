"""A low-precision format of linear weights, as a plug-in (`rollout.precision`, built-ins in
`precision/formats/`): the checkpoint tensors one weight becomes, the float values they stand
for, and the `quantization_config` SGLang reads. Conversion, the engine, weight pushes and the
trainer's QAT all call the same `quantize` / `dequantize`, so they see the same values.

A weight `<prefix>.weight` becomes tensors `<prefix>.<part>` (`parts`: e.g. `weight` and
`weight_scale_inv`). Formats with a tensor-wide scale (NVFP4) quantize a gate/up pair with one
amax (`shares_amax`): the plan passes the pair's."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from miles_core.plugins import NoOptions, PluginOptions, Registry, subclass_of

Parts = dict[str, torch.Tensor]  # part name (e.g. "weight_scale_inv") → tensor


class WeightFormat:
    name: str = ""  # as registered (set by `build_format`)
    Options: ClassVar[type[PluginOptions]] = NoOptions
    shares_amax: ClassVar[bool] = False  # gate and up quantized with one global amax
    quantizes: ClassVar[bool] = True  # False: the identity (`none`)
    # parts laid out by the weight's rows (a trainer rank holding some rows holds those rows of
    # them); the other parts describe the whole weight (a per-tensor scale, a block grid)
    row_parts: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, options: PluginOptions | None = None):
        self.options = options if options is not None else self.Options()

    def refuses(self, shape: tuple[int, ...]) -> str | None:
        """Why a weight of this shape cannot take the format (None: it can)."""
        if len(shape) != 2:
            return f"a {len(shape)}-D tensor (the format quantizes 2-D linear weights)"
        return None

    def parts(self, shape: tuple[int, ...]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Each checkpoint tensor of a weight of `shape`: (shape, dtype)."""
        raise NotImplementedError

    def quantize(self, w: torch.Tensor, amax: torch.Tensor | None = None) -> Parts:
        raise NotImplementedError

    def dequantize(self, parts: Parts) -> torch.Tensor:
        """The float32 values the parts stand for (what a GEMM computes with)."""
        raise NotImplementedError

    # a weight split by rows over trainer ranks (p2p pushes, precision/shards.py): each rank
    # quantizes its rows with statistics of the whole weight, max-reduced over the ranks
    def stats(self, rows: torch.Tensor, start: int, shape: tuple[int, int]) -> torch.Tensor | None:
        """This rank's share of the whole-weight statistics (rows [start, …) of a weight of
        `shape`, maybe none); None: rows quantize alone."""
        return None

    def quantize_rows(
        self, rows: torch.Tensor, start: int, shape: tuple[int, int], stats: torch.Tensor | None
    ) -> Parts:
        """The parts of rows [start, …) given the reduced `stats`: `row_parts` for these rows,
        the other parts whole; bitwise what `quantize` of the whole weight gives."""
        return self.quantize(rows)

    def quantization_config(self, ignore: list[str]) -> dict[str, Any]:
        """config.json's `quantization_config`; `ignore`: the modules left unquantized."""
        raise NotImplementedError

    def side_files(self, ignore: list[str]) -> dict[str, dict[str, Any]]:
        """Other JSON files a checkpoint needs (file name → content)."""
        return {}

    def checkpoint_only(self, shape: tuple[int, ...]) -> Parts:
        """Tensors a converted checkpoint adds that pushes leave out (NVFP4's input_scale)."""
        return {}


class _FakeQuantize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w: torch.Tensor, fmt: WeightFormat, amax: torch.Tensor | None):
        with torch.no_grad():
            return fmt.dequantize(fmt.quantize(w.detach(), amax)).to(w.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None, None


def fake_quantize(
    w: torch.Tensor, fmt: WeightFormat, amax: torch.Tensor | None = None
) -> torch.Tensor:
    """The values the engine serves for `w`, in `w`'s dtype; the gradient passes straight
    through (QAT's straight-through estimator)."""
    return _FakeQuantize.apply(w, fmt, amax)


FORMATS: Registry[type[WeightFormat]] = Registry(
    "precision format",
    "rollout.precision",
    package="miles_core.precision.formats",
    example="package.module:Format",
    load=subclass_of(WeightFormat, "precision format"),
)


def build_format(name: str, options: Any = None) -> WeightFormat:
    fmt = FORMATS.get(name)(FORMATS.options(name, options))
    fmt.name = name
    return fmt
