"""Colocated transport: engine and trainer share one process; tensors are copied in place."""

from __future__ import annotations

import time

from miles_core.engines.protocol import TENSOR
from miles_core.weights.source import TrainerWeights
from miles_core.weights.transport import TRANSPORTS, PushStats, TransportBase


@TRANSPORTS.register("colocated")
class ColocatedTransport(TransportBase):
    route = TENSOR
    name = "colocated"

    def push(self, source: TrainerWeights, version: int, pause_mode: str = "abort") -> PushStats:
        t0 = time.perf_counter()
        for e in self.engines:
            e.pause(pause_mode)
        try:
            copied = 0
            for bucket in source.named_weights(self.bucket_bytes, self.dtype):
                for e in self.engines:
                    copied += e.update_weights_from_tensor(bucket)
            for e in self.engines:
                e.set_weight_version(version)
        finally:
            for e in self.engines:
                e.resume()
        return self._record(copied, t0, version)
