"""P2P transport: every trainer rank sends its own shard of each parameter straight to the
engines, with no gather on rank 0.

The transfer follows the trainer's placement plan (`TrainerWeights.shard_plan`: for each HF name
the full shape, the dtype sent and the (dim, start, length) slice each trainer rank holds; FSDP2
holds dim-0 chunks). The plan travels with `/update_weights_from_distributed`
(`load_format: "p2p_shards"`, field `plan`); the engine checks it, receives each tensor's pieces
from their ranks into one full tensor and loads the whole set, all or nothing, with the new
version. The group (trainer ranks 0..N-1, engines N..N+E-1) is formed at the first push: every
trainer rank joins through the trainer's SPMD calls. On the wire each trainer rank sends one
flat buffer per dtype to each engine (weights/group.py `send_pieces`), not one per tensor; one
engine that takes `paused_push` gets the whole push in one HTTP call.
"""

from __future__ import annotations

import time

from miles_core.weights.group_transport import GroupTransport
from miles_core.weights.receiver import P2P_FORMAT
from miles_core.weights.remote import one_call, paused
from miles_core.weights.source import TrainerWeights
from miles_core.weights.transport import TRANSPORTS, PushStats


@TRANSPORTS.register("p2p")
class P2PTransport(GroupTransport):
    snapshots = False  # each trainer rank sends the shards it holds
    group_name = "miles_weight_p2p"
    name = "p2p"

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self._joined = False

    def connect(self, engines: list) -> None:
        super().connect(engines)
        self._joined = False  # fresh engines: the next push forms the group again

    def push(self, source: TrainerWeights, version: int, pause_mode: str = "abort") -> PushStats:
        t0 = time.perf_counter()
        world = source.world
        plan = source.shard_plan(self.dtype)  # before any collective: plain buckets fail here
        if not self._joined:  # all trainer ranks join (SPMD), engines after them
            self._form_group(world, source.join_group)
            self._joined = True
        body = {
            "names": [t.name for t in plan],
            "shapes": [list(t.shape) for t in plan],
            "dtypes": [t.dtype for t in plan],
            "group_name": self.group_name,
            "load_format": P2P_FORMAT,
            "plan": [t.to_json() for t in plan],
            "senders": world,
            "weight_version": str(version),
        }
        alone = one_call(self.engines)
        if alone:  # the engine pauses, receives, loads and continues within this one call
            body["pause_mode"] = pause_mode
        with paused(self.engines, pause_mode, skip=alone, check=not alone):
            calls = self._post_all("/update_weights_from_distributed", body)
            sent = source.send_shards([world + i for i in range(len(self.engines))], self.dtype)
            self._wait(calls, "failed to load")
        # rank 0's own bytes stand for the push: the other ranks send theirs in parallel
        return self._record(sent * world, t0, version)
