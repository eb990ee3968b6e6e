"""The weight-transport protocol: how a trainer's new weights reach the rollout engines.

`connect(engines)` (refusing an engine that lacks the transport's `route`), then per push
`push(source, version, pause_mode)`: the transport takes the trainer's weights from `source`
(weights/source.py: buckets of full tensors, or per-rank shards) with its own bucket size and
dtype, and runs pause → transfer → set version → continue, recording bytes, seconds and GB/s;
`close()` at the end.

A transport is a class in `weights/transports/` (or anywhere, named by import path) registered
with `@TRANSPORTS.register(name)`; `build(context, options)` makes it from what the run offers
every transport (`TransportContext`) and its own `Options` (`weight_sync.transport_options`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from miles_core.engines.protocol import RolloutEngine, require_route
from miles_core.plugins import NoOptions, PluginOptions, Registry
from miles_core.weights.source import Bucket, TrainerWeights

__all__ = [
    "TRANSPORTS",
    "Bucket",
    "PushStats",
    "TransportBase",
    "TransportContext",
    "WeightTransport",
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


@dataclass
class TransportContext:
    """What a run offers every transport: how to read the trainer's weights (weight_sync's
    `bucket_mb`, `dtype`), the trainer's distributed backend (a group transport's group), the
    ports it may bind (network.port_range), its working directory and fsspec options."""

    bucket_bytes: int = 64 << 20
    dtype: str | None = None
    dist_backend: str = "gloo"
    ports: Any = None  # miles_core.processes.ports.PortRange | None
    workdir: Path = Path(".")
    storage_options: dict = field(default_factory=dict)

    @classmethod
    def of_run(cls, config: Any, workdir: Path | str, dist_backend: str = "gloo") -> Any:
        """What run `config` offers its transport (and, alike, its engine servers' roots)."""
        ws = config.weight_sync
        return cls(
            bucket_bytes=ws.bucket_mb << 20,
            dtype=ws.dtype,
            dist_backend=dist_backend,
            ports=config.network.ports,
            workdir=Path(workdir),
            storage_options=config.checkpoint.storage_options,
        )


class TransportBase(RecordsPushes):
    """What every transport holds: its engines, the route it needs, how it reads the source
    (`bucket_bytes`, `dtype`: weight_sync.bucket_mb / weight_sync.dtype)."""

    route: str = ""
    name: str = ""
    # connect() can take a fresh engine server mid-run (a replaced one); group transports cannot
    # re-form their group with it
    reconnects = True
    # pushes read full tensors (`named_weights`), so a snapshot of them can be pushed while the
    # trainer trains on; a transport sending each rank's shards cannot
    snapshots = True
    # LoRA pushes to an engine that cannot replace an adapter in place (no LORA_UPSERT) load
    # each push as a new adapter version from a peft directory (lora/versions.py)
    adapter_versions = False

    Options: type[PluginOptions] = NoOptions

    def __init__(self, bucket_bytes: int = 64 << 20, dtype: torch.dtype | str | None = None):
        self.bucket_bytes = int(bucket_bytes)
        self.dtype = push_dtype(dtype)
        self.engines: list = []

    @classmethod
    def build(cls, context: TransportContext, options: PluginOptions) -> TransportBase:
        """The transport a run uses: `context`'s bucket size and dtype, and its own options."""
        return cls(bucket_bytes=context.bucket_bytes, dtype=context.dtype, **dict(options))

    @classmethod
    def engine_roots(cls, context: TransportContext, options: PluginOptions) -> tuple[str, ...]:
        """The roots the run's engine servers may load weights from on disk (none: they refuse
        every disk load)."""
        return ()

    def connect(self, engines: list) -> None:
        self.engines = require_route(engines, self.route, self.name or type(self).__name__)

    def buckets(self, source: TrainerWeights) -> list[Bucket]:
        """Every bucket of the source, consumed (each is a collective on the trainer's ranks)."""
        return [list(b) for b in source.named_weights(self.bucket_bytes, self.dtype)]

    def close(self) -> None:
        pass


class WeightTransport(Protocol):
    route: str  # the weight route (engines/protocol.py) an engine must take for this transport
    reconnects: bool  # connect() may be called again with a replaced engine

    def connect(self, engines: list[RolloutEngine]) -> None: ...

    def push(
        self, source: TrainerWeights, version: int, pause_mode: str = "abort"
    ) -> PushStats: ...

    def metrics(self) -> dict[str, float]: ...

    def close(self) -> None: ...


def _transport_class(obj: object, name: str) -> type:
    if not isinstance(obj, type) or not callable(getattr(obj, "build", None)):
        raise ValueError(
            f"weight transport {name!r} is not a transport class (a TransportBase subclass, or "
            f"a class with build(context, options)): {obj!r}"
        )
    return obj


TRANSPORTS: Registry[type] = Registry(
    "weight transport",
    "weight_sync.transport",
    package="miles_core.weights.transports",
    example="package.module:Class",
    load=_transport_class,
)
