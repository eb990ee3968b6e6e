"""The trainer-backend protocol (FSDP2 and Megatron-core behind the same calls).

A backend is a class in `train/backends/` registering itself (`@BACKENDS.register(name)`), or one
named by import path; `BACKENDS.get(train.backend)` is built from keyword arguments every backend
takes: `model_dir, optim (settings), loss (settings, None for SFT), total_steps, seed, device`.

Its public calls run on rank 0; under torchrun the other ranks replay them (SPMD: each public
call announces itself; `distributed.follow` rebuilds the same backend class from the "init"
announcement and calls `_<name>` with the same arguments). The generic step loop
(`miles_core.train.step`) and the losses (`miles_core.train.losses`, by registered name) are
shared; a backend supplies the micro-batch level (`StepBackend`: forward → per-token log-probs and
entropy, backward, optimizer step) and how weights leave it (`TrainerWeights`, defined with the
transports in `miles_core.weights.source`).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from miles_core.plugins import Registry
from miles_core.train.batch import TrainBatch
from miles_core.train.step import StepBackend
from miles_core.weights.source import TrainerWeights


class BackendFactory(Protocol):
    def __call__(
        self,
        model_dir: str,
        optim: dict[str, Any],
        loss: dict[str, Any] | None = None,
        total_steps: int = 1,
        seed: int = 0,
        device: str = "cpu",
    ) -> TrainerBackend: ...


class TrainerBackend(StepBackend, TrainerWeights, Protocol):
    rank: int
    world: int
    device: torch.device
    # the training forward differs from a no-grad one (dropout): π_old is then always
    # recomputed, never taken from the training forward (`TrainBatch.old_is_current`)
    stochastic_forward: bool

    def compute_log_probs(self, batch: TrainBatch) -> list[list[float]]:
        """Per-sample response log-probs under the current weights (rank 0 gets all)."""
        ...

    def keep_weights(self, version: int, oldest: int) -> None:
        """Keeps a copy of the current weights as policy `version`; forgets those before
        `oldest`."""
        ...

    def kept_versions(self) -> list[int]: ...

    def compute_log_probs_at(self, version: int, batch: TrainBatch) -> list[list[float]]:
        """`compute_log_probs` under the weights kept as `version`."""
        ...

    def train_step(self, batch: TrainBatch, loss: str = "policy") -> dict[str, float]:
        """One optimizer step over the global batch with the loss registered as `loss`
        (`policy`, `sft`, or an import path); metrics reduced over the ranks."""
        ...

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Rank 0: every tensor unsharded, HF names, tied duplicates dropped (checkpoints)."""
        ...

    def save(self, directory: str) -> None: ...

    def load(self, directory: str) -> None: ...

    def close(self) -> None: ...


def _backend_class(obj: Any, name: str) -> Any:
    if not callable(obj):
        raise ValueError(f"trainer backend {name!r} is not a class or factory: {obj!r}")
    return obj


BACKENDS: Registry[Any] = Registry(
    "trainer backend",
    "train.backend",
    package="miles_core.train.backends",
    example="package.module:Class",
    load=_backend_class,
)


def backend_path(cls: type) -> str:
    """The import path that rebuilds `cls` in another process (a follower rank)."""
    return f"{cls.__module__}:{cls.__qualname__}"
