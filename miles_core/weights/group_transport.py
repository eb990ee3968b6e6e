"""What the transports over a process group (broadcast, p2p) share: the rendezvous hosted in the
trainer's process, engines joining the group over HTTP while the trainer side joins too, control
calls to every engine in parallel, and leaving the group on close."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable

from miles_core.engines.protocol import DISTRIBUTED
from miles_core.plugins import PluginOptions
from miles_core.weights.group import BACKENDS, host_store
from miles_core.weights.remote import PushFailed, check_reachable
from miles_core.weights.transport import TransportBase, TransportContext


class GroupTransport(TransportBase):
    route = DISTRIBUTED
    group_name = "miles_weights"
    reconnects = False  # the group holds the old engine's rank

    @classmethod
    def build(cls, context: TransportContext, options: PluginOptions) -> GroupTransport:
        """Over the trainer's distributed backend; the rendezvous inside network.port_range."""
        return cls(
            group_backend=context.dist_backend,
            group_ports=context.ports,
            bucket_bytes=context.bucket_bytes,
            dtype=context.dtype,
            **dict(options),
        )

    def __init__(
        self,
        host: str = "127.0.0.1",
        timeout_s: float = 120.0,
        group_backend: str = "gloo",
        group_ports: range | None = None,
        **options,
    ) -> None:
        super().__init__(**options)
        if group_backend not in BACKENDS:
            raise ValueError(f"unknown group backend {group_backend!r}; choose one of {BACKENDS}")
        self.host = host
        self.timeout_s = timeout_s
        self.backend = (
            group_backend  # gloo for CPU tensors, nccl for CUDA (miles_core.device.dist_backend)
        )
        self.ports = group_ports
        self._store = None  # the rendezvous this process hosts, kept for the group's life
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=8)

    def _form_group(self, first_engine_rank: int, join_here: Callable[[dict], None]) -> None:
        """Engines join as ranks first_engine_rank.. over HTTP while `join_here({host, port,
        world, backend})` joins this side (it blocks until everyone is in). A dead engine fails
        first."""
        check_reachable(self.engines)  # a dead engine would stall the rendezvous until timeout
        world = first_engine_rank + len(self.engines)
        self._store = host_store(self.host, world, self.timeout_s, self.ports)
        port = self._store.port
        joins = self._post_all(
            "/init_weights_update_group",
            lambda i: {
                "master_address": self.host,
                "master_port": port,
                "rank_offset": first_engine_rank + i,
                "world_size": world,
                "group_name": self.group_name,
                "backend": self.backend,
            },
        )
        try:
            join_here({"host": self.host, "port": port, "world": world, "backend": self.backend})
        finally:
            self._wait(joins, "did not join the weight group")

    def _post_all(self, path: str, body: Callable[[int], dict] | dict) -> list:
        return [
            self._pool.submit(e.post, path, body(i) if callable(body) else body)
            for i, e in enumerate(self.engines)
        ]

    def _wait(self, calls: list, failure: str) -> None:
        for e, c in zip(self.engines, calls, strict=True):
            try:
                c.result(timeout=self.timeout_s)
            except Exception as err:  # noqa: BLE001
                raise PushFailed(f"engine at {e.url} {failure}: {err}") from err

    def close(self) -> None:
        for e in self.engines:
            try:
                e.post("/destroy_weights_update_group", {"group_name": self.group_name})
            except Exception:  # noqa: BLE001  (engine already gone)
                pass
        self._pool.shutdown(wait=False)
        self._store = None
