"""What the in-process engines share: all-or-nothing weight loading by HF name, and their
checksum. (The engine protocol itself is `miles_core/engines/protocol.py`.)"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from miles_core.weights.checker import weights_checksum


class PackedWeightsDiffer(RuntimeError):
    """The copies an engine generates with are not its weights (a weights check)."""


def tensors_checksum(named: dict[str, torch.Tensor]) -> str:
    """The checksum an in-process engine answers `weights_checksum()` with (its own tensors)."""
    return weights_checksum(named.items())


def load_named_tensors(
    params: dict[str, torch.Tensor],
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    adopt: bool = False,
) -> int:
    """Copies tensors into parameters by HF name, all or nothing: every name and shape is checked
    before the first copy. With `adopt`, parameters take the tensors' storage instead of copying
    (zero-copy; the caller guarantees nobody writes that storage while it is in use), or a
    converted copy of their own if the dtypes differ (bf16 pushes into fp32 parameters, exact).
    Returns the bytes loaded."""
    pairs = list(named_tensors)
    for name, tensor in pairs:
        param = params.get(name)
        if param is None:
            raise KeyError(f"engine has no parameter named {name!r}")
        if param.shape != tensor.shape:
            raise ValueError(
                f"{name}: engine shape {tuple(param.shape)} != pushed {tuple(tensor.shape)}"
            )
    with torch.no_grad():
        for name, tensor in pairs:
            if adopt:  # another dtype or device: owned memory, no parameter views an old push
                params[name].data = tensor.to(device=params[name].device, dtype=params[name].dtype)
            else:
                params[name].copy_(tensor)
    return sum(t.numel() * t.element_size() for _, t in pairs)
