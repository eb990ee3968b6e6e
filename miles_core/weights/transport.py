"""The weight-transport protocol: how a trainer's new weights reach the rollout engines.

Lifecycle of every push: pause → bucketed transfer → set version → continue, with bytes,
seconds and GB/s recorded. Transports register by name (`register_transport`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

from miles_core.rollout.engine import RolloutEngine

Bucket = list[tuple[str, torch.Tensor]]


@dataclass
class PushStats:
    bytes: int = 0
    seconds: float = 0.0
    version: int = 0

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def as_metrics(self) -> dict[str, float]:
        return {
            "perf/weight_sync_bytes": float(self.bytes),
            "perf/weight_sync_time_s": self.seconds,
            "perf/weight_sync_gbps": self.gbps,
        }


class RecordsPushes:
    """The bookkeeping every transport shares: the last push's stats and their metrics."""

    last: PushStats = PushStats()

    def _record(self, nbytes: int, started: float, version: int) -> PushStats:
        self.last = PushStats(bytes=nbytes, seconds=time.perf_counter() - started, version=version)
        return self.last

    def metrics(self) -> dict[str, float]:
        return self.last.as_metrics()


class WeightTransport(Protocol):
    def connect(self, engines: list[RolloutEngine]) -> None: ...

    def push(
        self, buckets: Iterable[Bucket], version: int, pause_mode: str = "abort"
    ) -> PushStats: ...

    def metrics(self) -> dict[str, float]: ...


_TRANSPORTS: dict[str, Callable[..., WeightTransport]] = {}


def register_transport(name: str, factory: Callable[..., WeightTransport]) -> None:
    """`factory(**options)` builds the transport; it takes the options it knows (e.g. the disk
    transport's `root`) and ignores the rest."""
    _TRANSPORTS[name] = factory


def make_transport(name: str, **options) -> WeightTransport:
    if name not in _TRANSPORTS:
        raise ValueError(f"unknown weight transport {name!r}; known: {sorted(_TRANSPORTS)}")
    return _TRANSPORTS[name](**options)
