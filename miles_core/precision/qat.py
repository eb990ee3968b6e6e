"""Quantization-aware training (`train.qat`): each weight the plan quantizes is computed with
as `plan.fake_quantize` makes it — exactly the values the engine serves after a push, the same
`quantize` / `dequantize` calls on the same float32 weights — and its gradient passes straight
through to the float weight, which the optimizer keeps updating in full precision.

A linear module's `forward` is replaced; a fused experts module (3-D `gate_up_proj`,
`down_proj`) runs its own forward with those parameters swapped for their fake-quantized
values for the call. Parameters, names and sharding are untouched, so FSDP2, checkpoints and
pushes see the float weights. Forwards that read weights themselves (the invariant forward of
true on-policy) read them through `served` / `served_param`."""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from miles_core.precision.plan import QuantPlan, partner

_QAT = "_miles_qat"  # a module's (plan, {attribute: full weight name}, partner module)


def served_param(module: torch.nn.Module, attr: str) -> torch.Tensor:
    """Parameter `attr` of `module` as the forward computes with it (fake-quantized under QAT)."""
    w = getattr(module, attr)
    qat = getattr(module, _QAT, None)
    if qat is None or attr not in qat[1]:
        return w
    plan, names, other = qat
    return plan.fake_quantize(names[attr], w, other.weight if other is not None else None)


def served(module: torch.nn.Module) -> torch.Tensor:
    """The weight a linear module computes with."""
    return served_param(module, "weight")


def _linear_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, served(self), self.bias)


def _experts_forward(self: torch.nn.Module, *args, **kwargs):
    _, names, _ = getattr(self, _QAT)
    saved = {a: self._parameters[a] for a in names}
    try:  # the class's forward reads the swapped entries; autograd reaches the parameters
        for a in names:
            self._parameters[a] = served_param(self, a)
        return type(self).forward(self, *args, **kwargs)
    finally:
        self._parameters.update(saved)


def install(model: torch.nn.Module, plan: QuantPlan) -> list[str]:
    """Turns QAT on for every weight of `model` the plan quantizes; returns their names."""
    modules = dict(model.named_modules())
    names = []
    for name, module in modules.items():
        if isinstance(module, torch.nn.Linear):
            weight = f"{name}.weight"
            if not plan.quantized(weight, tuple(module.weight.shape)):
                continue
            other = partner(weight) if plan.fmt.shares_amax else None
            other_module = modules.get(other.removesuffix(".weight")) if other else None
            setattr(module, _QAT, (plan, {"weight": weight}, other_module))
            module.forward = types.MethodType(_linear_forward, module)
            names.append(weight)
            continue
        fused = {
            a: f"{name}.{a}"
            for a, p in module.named_parameters(recurse=False)
            if p.dim() == 3 and plan.quantized(f"{name}.{a}", tuple(p.shape))
        }
        if fused:
            setattr(module, _QAT, (plan, fused, None))
            module.forward = types.MethodType(_experts_forward, module)
            names += list(fused.values())
    return names
