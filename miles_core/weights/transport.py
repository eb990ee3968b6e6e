"""The weight-transport protocol: how a trainer's new weights reach the rollout engines.

`connect(engines)` (refusing an engine that lacks the transport's `route`), then per push
`push(source, version, pause_mode)`: the transport takes the trainer's weights from `source`
(weights/source.py: buckets of full tensors, or per-rank shards) with its own bucket size and
dtype, and runs pause → transfer → set version → continue, recording bytes, seconds and GB/s;
`close()` at the end. Transports register by name (`register_transport`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from miles_core.engines.protocol import RolloutEngine, require_route
from miles_core.plugins import Registry
from miles_core.weights.source import Bucket, TrainerWeights

__all__ = [
    "Bucket",
    "PushStats",
    "TransportBase",
    "WeightTransport",
    "make_transport",
    "register_transport",
    "transport_route",
]


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


def push_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """The dtype pushed weights travel in; None (or float32): the trainer's own."""
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return None if dtype in (None, torch.float32) else dtype


class TransportBase(RecordsPushes):
    """What every transport holds: its engines, the route it needs, how it reads the source
    (`bucket_bytes`, `dtype`: weight_sync.bucket_mb / weight_sync.dtype)."""

    route: str = ""
    name: str = ""
    # connect() can take a fresh engine server mid-run (a replaced one); group transports cannot
    # re-form their group with it
    reconnects = True

    def __init__(
        self,
        bucket_bytes: int = 64 << 20,
        dtype: torch.dtype | str | None = None,
        **_options,
    ) -> None:
        self.bucket_bytes = int(bucket_bytes)
        self.dtype = push_dtype(dtype)
        self.engines: list = []

    def connect(self, engines: list) -> None:
        self.engines = require_route(engines, self.route, self.name or type(self).__name__)

    def buckets(self, source: TrainerWeights) -> list[Bucket]:
        """Every bucket of the source, consumed (each is a collective on the trainer's ranks)."""
        return [list(b) for b in source.named_weights(self.bucket_bytes, self.dtype)]

    def close(self) -> None:
        pass


class WeightTransport(Protocol):
    route: str  # the weight route (engine_api) an engine must take for this transport
    reconnects: bool  # connect() may be called again with a replaced engine

    def connect(self, engines: list[RolloutEngine]) -> None: ...

    def push(
        self, source: TrainerWeights, version: int, pause_mode: str = "abort"
    ) -> PushStats: ...

    def metrics(self) -> dict[str, float]: ...

    def close(self) -> None: ...


def _transport_factory(obj: object, name: str) -> Callable[..., WeightTransport]:
    if not callable(obj):
        raise ValueError(f"weight transport {name!r} is not a class or factory: {obj!r}")
    return obj


TRANSPORTS: Registry[Callable[..., WeightTransport]] = Registry(
    "weight transport", "weight_sync.transport", load=_transport_factory
)


def register_transport(name: str, factory: Callable[..., WeightTransport] | str) -> None:
    """`factory(**options)` builds the transport; it takes the options it knows (e.g. the disk
    transport's `root`; every one `bucket_bytes` and `dtype`) and ignores the rest. A config may
    also name a factory by import path `pkg.mod:Factory`."""
    TRANSPORTS.register(name, factory)


def transport_names() -> list[str]:
    return TRANSPORTS.names()


def transport_route(name: str) -> str:
    """The weight route transport `name` needs (for config checks before anything starts)."""
    return str(getattr(TRANSPORTS.get(name), "route", ""))


def make_transport(name: str, **options) -> WeightTransport:
    return TRANSPORTS.get(name)(**options)
