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

    def named_tensors(self) -> dict[str, torch.Tensor]: ...

    def pause(self, mode: str = "abort") -> None: ...

    def resume(self) -> None: ...
