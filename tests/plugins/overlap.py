"""A trainer backend and a weight transport that show a push overlapping training: the transport
holds its push of version 1 until the backend has taken an optimizer step after that push
began. Only a trainer that trains on while its policy is pushed (fully_async's overlapped push)
releases it; a trainer waiting for the push never would, and the push fails after its timeout.
"""

from __future__ import annotations

import threading

from miles_core.train.backend import BACKENDS
from miles_core.weights.transports.shared_memory import SharedMemoryTransport

STEPPED = threading.Condition()
STEPS = [0]  # optimizer steps taken
HELD: list[int] = []  # versions whose push was held until the trainer stepped
HOLD_TIMEOUT_S = 120.0


class SteppingBackend(BACKENDS.get("fsdp")):
    def _train_step(self, batch, loss):
        out = super()._train_step(batch, loss)
        with STEPPED:
            STEPS[0] += 1
            STEPPED.notify_all()
        return out


class HeldPush(SharedMemoryTransport):
    def push(self, source, version: int, pause_mode: str = "abort"):
        if version == 1:
            with STEPPED:
                before = STEPS[0]
                if not STEPPED.wait_for(lambda: STEPS[0] > before, timeout=HOLD_TIMEOUT_S):
                    raise RuntimeError("the trainer took no step while version 1 was pushed")
            HELD.append(version)
        return super().push(source, version, pause_mode)
