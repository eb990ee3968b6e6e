"""Broadcast transport: one process group of the trainer's sending rank (rank 0) and every
engine (ranks 1..N), as SGLang's `/init_weights_update_group` + `/update_weights_from_distributed`.

Per bucket: the metadata (names, dtypes, shapes) goes to each engine over HTTP, then one
broadcast per dtype of the bucket flattened into one buffer. Engines stage buckets and load them
together, all or nothing, at the last bucket, which carries the new version; an engine that
refuses a bucket still receives its bytes (the group stays in step), drops what it staged and
answers 400, so the next push starts clean (weights/receiver.py). Every push is pause (mode) →
broadcast → version → continue; an engine that cannot be paused fails the push before anything
was sent. One engine that takes `paused_push` (our server) pauses and continues itself within the
bucket calls (`pause_mode` in the body): no separate pause and continue round trips.
"""

from __future__ import annotations

import time

from miles_core.weights.group import Scratch, flat_layout, open_group, send_bucket
from miles_core.weights.group_transport import GroupTransport
from miles_core.weights.remote import one_call, paused
from miles_core.weights.source import TrainerWeights, dtype_name
from miles_core.weights.transport import TRANSPORTS, PushStats


@TRANSPORTS.register("broadcast")
class BroadcastTransport(GroupTransport):
    group_name = "miles_weight_broadcast"
    name = "broadcast"

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self.group = None
        self.scratch = Scratch()  # the flat send buffers, kept from push to push

    def connect(self, engines: list) -> None:
        """Opens the group: each engine joins over HTTP while this process joins as rank 0."""
        super().connect(engines)

        def join_here(g: dict) -> None:
            self.group = open_group(
                g["host"], g["port"], 0, g["world"], self.timeout_s, g["backend"]
            )

        self._form_group(1, join_here)

    def push(self, source: TrainerWeights, version: int, pause_mode: str = "abort") -> PushStats:
        if self.group is None:
            raise RuntimeError("broadcast transport is not connected; call connect(engines)")
        t0 = time.perf_counter()
        buckets = self.buckets(source)  # consume every bucket (trainer collectives)
        bodies = []
        for i, bucket in enumerate(buckets):
            body = {
                "names": [n for n, _ in bucket],
                "dtypes": [dtype_name(t.dtype) for _, t in bucket],
                "shapes": [list(t.shape) for _, t in bucket],
                "group_name": self.group_name,
            }
            if i == len(buckets) - 1:
                body["weight_version"] = str(version)
            flat_layout(body["names"], body["dtypes"], body["shapes"])  # before anything is sent
            bodies.append(body)
        pg = self.group[1]
        nbytes = 0
        self.scratch.start()
        alone = one_call(self.engines)
        with paused(self.engines, pause_mode, skip=alone, check=not alone):
            for bucket, body in zip(buckets, bodies, strict=True):
                if alone:  # the engine pauses for the first bucket, continues after the last
                    body["pause_mode"] = pause_mode
                calls = self._post_all("/update_weights_from_distributed", body)
                nbytes += send_bucket(pg, bucket, self.scratch)
                self._wait(calls, "failed to load")
        return self._record(nbytes * len(self.engines), t0, version)

    def close(self) -> None:
        super().close()
        self.group = None
