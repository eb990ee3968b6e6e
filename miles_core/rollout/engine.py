"""The rollout-engine protocol every engine (embedded, HTTP, SGLang) implements."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch

from miles_core.rollout.protocol import GenerateRequest, GenerateResponse


class RolloutEngine(Protocol):
    @property
    def weight_version(self) -> int: ...

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateResponse]: ...

    def update_weights_from_tensor(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Loads tensors by HF name; returns the bytes copied."""
        ...

    def set_weight_version(self, version: int) -> None: ...

    def load_counters(self) -> dict[str, float]:
        """Cumulative counters: `steps` (forward steps), `running_sum` and `waiting_sum` (the
        requests decoding / queued, summed over steps); {} if the engine does not report them.
        Differences across a rollout give its mean active requests and queue depth."""
        ...

    def named_tensors(self) -> dict[str, torch.Tensor]: ...

    def pause(self, mode: str = "abort") -> None: ...

    def resume(self) -> None: ...


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
            if adopt:  # another dtype: owned memory, so no parameter still views an old push
                params[name].data = tensor.to(params[name].dtype)
            else:
                params[name].copy_(tensor)
    return sum(t.numel() * t.element_size() for _, t in pairs)
