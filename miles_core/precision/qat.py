"""Quantization-aware training (`train.qat`): each linear module the plan quantizes computes
with `fake_quantize(weight)` — exactly the values the engine serves after a push, the same
`quantize` / `dequantize` calls on the same float32 weights — and its gradient passes straight
through to the float weight, which the optimizer keeps updating in full precision.

The module's `forward` is replaced (its parameters, names and sharding are untouched, so FSDP2,
checkpoints and pushes see the float weights); forwards that read weights themselves (the
invariant forward of true on-policy) read them through `served(module)`."""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from miles_core.precision.format import fake_quantize
from miles_core.precision.plan import QuantPlan, partner

_QAT = "_miles_qat"  # the attribute holding a module's (format, partner module)


def served(module: torch.nn.Module) -> torch.Tensor:
    """The weight a linear module computes with: fake-quantized under QAT, else its own."""
    qat = getattr(module, _QAT, None)
    if qat is None:
        return module.weight
    fmt, other = qat
    amax = None
    if other is not None:  # a gate/up pair of a shared-amax format (NVFP4)
        w, o = module.weight.detach(), other.weight.detach()
        amax = torch.maximum(w.float().abs().amax(), o.float().abs().amax())
    return fake_quantize(module.weight, fmt, amax)


def _forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, served(self), self.bias)


def install(model: torch.nn.Module, plan: QuantPlan) -> list[str]:
    """Turns QAT on for every linear module of `model` whose weight the plan quantizes;
    returns their weights' names."""
    modules = dict(model.named_modules())
    names = []
    for name, module in modules.items():
        if not isinstance(module, torch.nn.Linear):
            continue
        weight = f"{name}.weight"
        if not plan.quantized(weight, tuple(module.weight.shape)):
            continue
        other = partner(weight) if plan.fmt.shares_amax else None
        other_module = modules.get(other[: -len(".weight")]) if other else None
        setattr(module, _QAT, (plan.fmt, other_module))
        module.forward = types.MethodType(_forward, module)
        names.append(weight)
    return names
