"""Colocated transport: engine and trainer share one process; tensors are copied in place."""

from __future__ import annotations

import time
from collections.abc import Iterable

from miles_core.rollout.engine import RolloutEngine
from miles_core.weights.transport import Bucket, PushStats, RecordsPushes, register_transport


class ColocatedTransport(RecordsPushes):
    def __init__(self, **_options) -> None:
        self.engines: list[RolloutEngine] = []

    def connect(self, engines: list[RolloutEngine]) -> None:
        self.engines = list(engines)

    def push(self, buckets: Iterable[Bucket], version: int, pause_mode: str = "abort") -> PushStats:
        t0 = time.perf_counter()
        for e in self.engines:
            e.pause(pause_mode)
        try:
            copied = 0
            for bucket in buckets:
                for e in self.engines:
                    copied += e.update_weights_from_tensor(bucket)
            for e in self.engines:
                e.set_weight_version(version)
        finally:
            for e in self.engines:
                e.resume()
        return self._record(copied, t0, version)


register_transport("colocated", ColocatedTransport)
