"""The trainer-backend protocol (FSDP2 now; Megatron-core later behind the same calls)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import torch

from miles_core.train.batch import TrainBatch


class TrainerBackend(Protocol):
    def compute_log_probs(self, batch: TrainBatch) -> list[list[float]]:
        """Per-sample response log-probs under the current weights (rank 0 gets all)."""
        ...

    def train_step(self, batch: TrainBatch, loss: str = "policy") -> dict[str, float]:
        """One optimizer step over the global batch; `loss` is 'policy' (RL) or 'sft'."""
        ...

    def named_weights(
        self, bucket_bytes: int, dtype: torch.dtype | None = None
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full (unsharded) tensors with HF names, in buckets of about `bucket_bytes`, cast to
        `dtype` if given (a push in the engines' dtype)."""
        ...

    def save(self, directory: str) -> None: ...

    def load(self, directory: str) -> None: ...

    def close(self) -> None: ...
