"""Trainer ranks as Ray actors, and the driver's handle on them.

Each rank is an actor on its bundle. They form the torch.distributed group across actors (rank
0's node address and a free port of it; gloo on CPU, nccl on GPUs), then ranks 1 … N-1 run
`distributed.follow()` and rank 0 builds the backend and runs every public call the driver
makes: rank 0 announces each call and the followers replay it, exactly as under torchrun
(`train/distributed.py`). The driver holds a `RayTrainer`, which forwards a call to rank 0 and
returns its result (an iterator's items as a list: the buckets of `named_weights`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

# what the driver reads as attributes of a trainer (the rest are calls)
ATTRIBUTES = ("rank", "world", "device", "stochastic_forward")


class TrainerRank:
    """One trainer rank (wrapped by `ray.remote` where it is placed)."""

    def __init__(self, env: dict[str, str]):
        os.environ.update(env)
        self.backend: Any = None

    def address(self, port_range: str | None) -> tuple[str, int]:
        """Rank 0: where the group's store listens (this node's address, a free port)."""
        import ray

        from miles_core.processes.ports import PortRange, free_port

        host = ray.util.get_node_ip_address()
        return host, free_port(host, PortRange.parse(port_range) if port_range else None)

    def init(self, rank: int, world: int, host: str, port: int, device: str) -> None:
        import ray

        from miles_core.train import distributed

        gpus = ray.get_gpu_ids()
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(int(gpus[0]) if gpus else 0),
            MASTER_ADDR=host,
            MASTER_PORT=str(port),
        )
        distributed.init_distributed(device)

    def follow(self) -> None:
        from miles_core.train import distributed

        distributed.follow()

    def build(self, backend: str, kwargs: dict[str, Any], fields: list) -> dict[str, Any]:
        """Rank 0: the run's per-token fields declared as the driver has them, then the
        backend; its attributes for the driver."""
        from miles_core.token_fields import declared_field
        from miles_core.train.backend import BACKENDS

        for f in fields:
            declared_field(f)
        self.backend = BACKENDS.get(backend)(**kwargs)
        attrs = {a: getattr(self.backend, a) for a in ATTRIBUTES if hasattr(self.backend, a)}
        if "device" in attrs:
            attrs["device"] = str(attrs["device"])
        calls = [
            n
            for n in dir(self.backend)
            if not n.startswith("_") and n not in attrs and callable(getattr(self.backend, n))
        ]
        return {"attributes": attrs, "calls": calls}

    def call(self, name: str, args: tuple, kwargs: dict) -> Any:
        result = getattr(self.backend, name)(*args, **kwargs)
        return list(result) if isinstance(result, Iterator) else result

    def shutdown(self) -> None:
        """Rank 0: the followers leave `follow()`; every rank leaves the group."""
        from miles_core.train import distributed

        distributed.shutdown()


class RayTrainer:
    """The driver's trainer: rank 0's public calls, run there."""

    def __init__(self, ranks: list[Any], following: list[Any], built: dict, timeout_s: float):
        import torch

        self._ranks = ranks
        self._following = following
        self._timeout_s = timeout_s
        self._closed = False
        self._calls = frozenset(built["calls"])  # rank 0's backend's public methods
        for name, value in built["attributes"].items():
            setattr(self, name, torch.device(value) if name == "device" else value)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name not in self._calls:
            raise AttributeError(f"the trainer backend has no {name!r}")

        def call(*args: Any, **kwargs: Any) -> Any:
            import ray

            return ray.get(self._ranks[0].call.remote(name, args, kwargs), timeout=self._timeout_s)

        return call

    def close(self) -> None:
        """Closes the backend, releases the followers and ends every rank's actor."""
        import ray

        if self._closed:
            return
        self._closed = True
        try:
            ray.get(self._ranks[0].call.remote("close", (), {}), timeout=self._timeout_s)
            ray.get(self._ranks[0].shutdown.remote(), timeout=self._timeout_s)
            ray.get(self._following, timeout=self._timeout_s)
        finally:
            for rank in self._ranks:
                ray.kill(rank)
