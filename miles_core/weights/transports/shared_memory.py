"""Shared-memory transport: trainer and engine servers on one host (colocated, CPU).

Every push: the trainer writes all buckets into /dev/shm files (weights/shm.py) → pauses every
engine (mode) → each engine maps the files and takes them as its parameters, zero-copy
(`/update_weights_from_tensor`, load_format shared_memory, with the new version) → continue.
Pausing first doubles as the reachability check: if any engine cannot be paused, nothing has been
loaded anywhere and the push fails naming it, so every engine keeps its previous weights and
version. `in_place` needs no pause call: the engine swaps weights between two decode steps and
its running requests keep their KV, which is what in_place means.

One engine that takes `paused_push` (engines/protocol.py: PAUSED_PUSH: our engine server) gets the whole
push in one HTTP call: the call carries `pause_mode` and the engine pauses, maps, loads, sets the
version and continues within it (three fixed round trips were most of a small push). An engine
that cannot be reached then fails that call, before it loaded anything. Several engines keep the
three steps, so that every one is paused before any loads.
"""

from __future__ import annotations

import time

from miles_core.engines.protocol import SHARED_MEMORY, ProcessUnavailable
from miles_core.weights.remote import PushFailed, one_call, paused
from miles_core.weights.shm import ShmBucketWriter
from miles_core.weights.source import TrainerWeights
from miles_core.weights.transport import TRANSPORTS, PushStats, TransportBase


@TRANSPORTS.register("shared_memory")
class SharedMemoryTransport(TransportBase):
    route = SHARED_MEMORY
    name = "shared_memory"

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self.writer = ShmBucketWriter()
        self._parity = 0  # the file set the next push writes (engines serve the other one)

    def push(self, source: TrainerWeights, version: int, pause_mode: str = "abort") -> PushStats:
        t0 = time.perf_counter()
        descriptions, nbytes = [], 0
        # consume every bucket (trainer collectives)
        for i, bucket in enumerate(source.named_weights(self.bucket_bytes, self.dtype)):
            descriptions.append(self.writer.write(i, bucket, self._parity, adopt=True))
            nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
        try:
            if one_call(self.engines):
                _one_call(self.engines[0], descriptions, version, pause_mode)
            else:
                with paused(self.engines, pause_mode, skip=pause_mode == "in_place"):
                    for e in self.engines:
                        e.update_weights_from_shared_memory(descriptions, version)
        except BaseException:
            # an engine may now serve from either file set (some took the push, some did not):
            # later pushes go to fresh files, so no set an engine may hold is ever written again
            self.writer = ShmBucketWriter()
            self._parity = 0
            raise
        self._parity ^= 1
        return self._record(nbytes * len(self.engines), t0, version)

    def close(self) -> None:
        self.writer.close()


def _one_call(engine, descriptions: list[str], version: int, pause_mode: str) -> None:
    """Pause (mode), load, version, continue: one `/update_weights_from_tensor` call."""
    body = {
        "serialized_named_tensors": descriptions,
        "load_format": "shared_memory",
        "weight_version": str(version),
        "pause_mode": pause_mode,
    }
    try:
        engine.post("/update_weights_from_tensor", body)
    except (ProcessUnavailable, OSError) as err:
        raise PushFailed(
            f"weight push aborted: engine at {engine.url} cannot be reached ({err})"
        ) from err
