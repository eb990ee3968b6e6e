"""Broadcast transport: one gloo group of the trainer's sending rank (rank 0) and every engine
(ranks 1..N), as SGLang's `/init_weights_update_group` + `/update_weights_from_distributed`.

Per bucket: the metadata (names, dtypes, shapes) goes to each engine over HTTP, then one
broadcast per dtype of the bucket flattened into one buffer. Engines stage buckets and load them
together, all or nothing, at the last bucket, which carries the new version. Every push is
pause (mode) → broadcast → version → continue; an engine that cannot be paused fails the push
before anything was sent.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterable

import torch

from miles_core.weights.group import broadcast, free_port, open_group
from miles_core.weights.remote import (
    PushFailed,
    RemoteEngine,
    check_reachable,
    paused,
    require_remote,
)
from miles_core.weights.transport import Bucket, PushStats, RecordsPushes, register_transport

GROUP = "miles_weight_broadcast"


class BroadcastTransport(RecordsPushes):
    def __init__(self, host: str = "127.0.0.1", timeout_s: float = 120.0, **_options) -> None:
        self.host = host
        self.timeout_s = timeout_s
        self.engines: list[RemoteEngine] = []
        self.group = None
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=8)

    def connect(self, engines: list) -> None:
        """Opens the group: each engine joins over HTTP while this process hosts the rendezvous."""
        self.engines = require_remote(engines, "broadcast")
        check_reachable(self.engines)  # a dead engine would stall the rendezvous until timeout
        port, world = free_port(self.host), 1 + len(self.engines)
        joins = [
            self._pool.submit(
                e._post,
                "/init_weights_update_group",
                {
                    "master_address": self.host,
                    "master_port": port,
                    "rank_offset": 1 + i,
                    "world_size": world,
                    "group_name": GROUP,
                    "backend": "gloo",
                },
            )
            for i, e in enumerate(self.engines)
        ]
        try:
            self.group = open_group(self.host, port, 0, world, self.timeout_s)
        finally:
            for e, j in zip(self.engines, joins, strict=True):
                try:
                    j.result(timeout=self.timeout_s)
                except Exception as err:  # noqa: BLE001
                    raise PushFailed(
                        f"engine at {e.url} did not join the weight broadcast group: {err}"
                    ) from err

    def push(self, buckets: Iterable[Bucket], version: int, pause_mode: str = "abort") -> PushStats:
        if self.group is None:
            raise RuntimeError("broadcast transport is not connected; call connect(engines)")
        t0 = time.perf_counter()
        buckets = [list(b) for b in buckets]  # consume every bucket (trainer collectives)
        pg = self.group[1]
        nbytes = 0
        with paused(self.engines, pause_mode):
            for i, bucket in enumerate(buckets):
                last = i == len(buckets) - 1
                body = {
                    "names": [n for n, _ in bucket],
                    "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                    "shapes": [list(t.shape) for _, t in bucket],
                    "group_name": GROUP,
                }
                if last:
                    body["weight_version"] = str(version)
                calls = [
                    self._pool.submit(e._post, "/update_weights_from_distributed", body)
                    for e in self.engines
                ]
                for dtype in sorted({str(t.dtype).removeprefix("torch.") for _, t in bucket}):
                    same = [t for _, t in bucket if str(t.dtype).removeprefix("torch.") == dtype]
                    flat = torch.cat([t.detach().reshape(-1) for t in same])
                    broadcast(pg, flat)
                    nbytes += flat.numel() * flat.element_size()
                for e, c in zip(self.engines, calls, strict=True):
                    try:
                        c.result(timeout=self.timeout_s)
                    except Exception as err:  # noqa: BLE001
                        raise PushFailed(f"engine at {e.url} failed to load: {err}") from err
        return self._record(nbytes * len(self.engines), t0, version)

    def close(self) -> None:
        for e in self.engines:
            try:
                e._post("/destroy_weights_update_group", {"group_name": GROUP})
            except Exception:  # noqa: BLE001  (engine already gone)
                pass
        self.group = None
        self._pool.shutdown(wait=False)


register_transport("broadcast", BroadcastTransport)
