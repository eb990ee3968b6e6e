"""P2P transport: every trainer rank sends its own FSDP shard of each parameter straight to the
engines, with no gather on rank 0.

The transfer plan is FSDP2's dim-0 sharding (`row_chunks`: torch.chunk over the trainer's ranks):
trainer rank r holds rows [a_r, b_r) of every parameter and sends them, in parameter order, to
each engine rank; the engine receives each parameter's chunks from ranks 0..N-1 into one full
tensor (`/update_weights_from_distributed` with `load_format: "p2p_shards/N"`) and loads the
whole set, all or nothing, with the new version. The group (trainer ranks 0..N-1, engines
N..N+E-1) is formed at the first push: every trainer rank joins through the trainer's SPMD calls.
"""

from __future__ import annotations

import time

import torch

from miles_core.weights.group_transport import GroupTransport
from miles_core.weights.remote import paused, require_remote
from miles_core.weights.transport import PushStats, register_transport


class P2PTransport(GroupTransport):
    group_name = "miles_weight_p2p"
    pushes_from_trainer = True  # the runtime calls push_from(trainer, …), not push(buckets, …)

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self._joined = False

    def connect(self, engines: list) -> None:
        self.engines = require_remote(engines, "p2p")

    def push(self, buckets, version: int, pause_mode: str = "abort") -> PushStats:
        raise TypeError("the p2p transport sends from every trainer rank: use push_from(trainer)")

    def push_from(
        self, trainer, version: int, pause_mode: str = "abort", dtype: torch.dtype | None = None
    ) -> PushStats:
        t0 = time.perf_counter()
        world = trainer.world
        if not self._joined:  # all trainer ranks join (SPMD), engines after them
            self._form_group(world, trainer.join_group)
            self._joined = True
        specs = trainer.param_specs(dtype)
        body = {
            "names": [n for n, _, _ in specs],
            "shapes": [s for _, s, _ in specs],
            "dtypes": [d for _, _, d in specs],
            "group_name": self.group_name,
            "load_format": f"p2p_shards/{world}",
            "weight_version": str(version),
        }
        with paused(self.engines, pause_mode):
            calls = self._post_all("/update_weights_from_distributed", body)
            sent = trainer.send_shards([world + i for i in range(len(self.engines))], dtype)
            self._wait(calls, "failed to load")
        # rank 0's own bytes stand for the push: the other ranks send theirs in parallel
        return self._record(sent * world, t0, version)


register_transport("p2p", P2PTransport)
