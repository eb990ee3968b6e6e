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

import concurrent.futures
import time

from miles_core.weights.group import free_port
from miles_core.weights.remote import (
    PushFailed,
    RemoteEngine,
    check_reachable,
    paused,
    require_remote,
)
from miles_core.weights.transport import PushStats, RecordsPushes, register_transport

GROUP = "miles_weight_p2p"


class P2PTransport(RecordsPushes):
    pushes_from_trainer = True  # the runtime calls push_from(trainer, …), not push(buckets, …)

    def __init__(self, host: str = "127.0.0.1", timeout_s: float = 120.0, **_options) -> None:
        self.host = host
        self.timeout_s = timeout_s
        self.engines: list[RemoteEngine] = []
        self._joined = False
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=8)

    def connect(self, engines: list) -> None:
        self.engines = require_remote(engines, "p2p")

    def push(self, buckets, version: int, pause_mode: str = "abort") -> PushStats:
        raise TypeError("the p2p transport sends from every trainer rank: use push_from(trainer)")

    def push_from(self, trainer, version: int, pause_mode: str = "abort") -> PushStats:
        t0 = time.perf_counter()
        world = trainer.world
        if not self._joined:
            self._join(trainer)
        specs = trainer.param_specs()
        body = {
            "names": [n for n, _, _ in specs],
            "shapes": [s for _, s, _ in specs],
            "dtypes": [d for _, _, d in specs],
            "group_name": GROUP,
            "load_format": f"p2p_shards/{world}",
            "weight_version": str(version),
        }
        with paused(self.engines, pause_mode):
            calls = [
                self._pool.submit(e._post, "/update_weights_from_distributed", body)
                for e in self.engines
            ]
            sent = trainer.send_shards([world + i for i in range(len(self.engines))])
            for e, c in zip(self.engines, calls, strict=True):
                try:
                    c.result(timeout=self.timeout_s)
                except Exception as err:  # noqa: BLE001
                    raise PushFailed(f"engine at {e.url} failed to load: {err}") from err
        # rank 0's own bytes stand for the push: the other ranks send theirs in parallel
        return self._record(sent * world, t0, version)

    def _join(self, trainer) -> None:
        check_reachable(self.engines)
        port, world = free_port(self.host), trainer.world + len(self.engines)
        joins = [
            self._pool.submit(
                e._post,
                "/init_weights_update_group",
                {
                    "master_address": self.host,
                    "master_port": port,
                    "rank_offset": trainer.world + i,
                    "world_size": world,
                    "group_name": GROUP,
                    "backend": "gloo",
                },
            )
            for i, e in enumerate(self.engines)
        ]
        trainer.join_group({"host": self.host, "port": port, "world": world})
        for e, j in zip(self.engines, joins, strict=True):
            try:
                j.result(timeout=self.timeout_s)
            except Exception as err:  # noqa: BLE001
                raise PushFailed(f"engine at {e.url} did not join the p2p group: {err}") from err
        self._joined = True

    def close(self) -> None:
        for e in self.engines:
            try:
                e._post("/destroy_weights_update_group", {"group_name": GROUP})
            except Exception:  # noqa: BLE001  (engine already gone)
                pass
        self._pool.shutdown(wait=False)


register_transport("p2p", P2PTransport)
