"""torch.distributed for the trainer: one process by default, N ranks under torchrun.

The group's backend follows the trainer's device (gloo on CPU, nccl on CUDA: `device.py`); the
control channel is always gloo. Under torchrun, rank 0 runs the flow and drives the trainer; the
other ranks run `follow()`, which builds the backend class rank 0 announced and replays every
trainer call rank 0 announces (SPMD), so collectives line up.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from miles_core.device import dist_backend, resolve_device

TIMEOUT = datetime.timedelta(seconds=int(os.environ.get("MILES_DIST_TIMEOUT_S", "600")))


def init_distributed(device: str | torch.device = "cpu") -> tuple[int, int]:
    """Joins the torchrun group if launched by torchrun, else makes a one-rank group; gloo for
    a CPU trainer, nccl for CUDA (each rank on the GPU of its LOCAL_RANK). A group that exists
    already is kept."""
    if not dist.is_initialized():
        dev = resolve_device(device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        backend = dist_backend(dev)
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend, timeout=TIMEOUT)
        else:
            dist.init_process_group(
                backend, store=dist.HashStore(), rank=0, world_size=1, timeout=TIMEOUT
            )
    if dist.get_world_size() > 1:
        _control()  # every rank creates the control group at the same point
    return dist.get_rank(), dist.get_world_size()


def launched_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


# Followers may wait long for rank 0's next call (a long rollout, an upload), so the control
# channel is its own gloo group with a long timeout; collectives keep the short one.
CONTROL_TIMEOUT = datetime.timedelta(days=7)
_control_group = None


def _control():
    global _control_group
    if _control_group is None:
        _control_group = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return _control_group


def announce(name: str, payload: Any) -> None:
    """Rank 0 tells the follower ranks which call to replay (no-op with one rank)."""
    if dist.is_initialized() and dist.get_world_size() > 1 and dist.get_rank() == 0:
        dist.broadcast_object_list([(name, payload)], src=0, group=_control())


def announce_init(backend: str, kwargs: dict[str, Any]) -> None:
    """Rank 0 building a backend: followers build the same one (its import path) with the same
    keyword arguments, and declare the per-token fields rank 0 has (its batches carry them)."""
    from miles_core.token_fields import FIELDS

    fields = [f.declaration() for f in FIELDS.values()]
    announce("init", {"backend": backend, "kwargs": kwargs, "token_fields": fields})


def receive() -> tuple[str, Any]:
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0, group=_control())
    return box[0]


def follow() -> None:
    """The loop of ranks > 0: build the trainer rank 0 builds, replay its calls, until 'exit'."""
    from miles_core.train.backend import BACKENDS

    backend: Any = None
    while True:
        name, payload = receive()
        if name == "exit":
            _teardown()
            return
        if name == "init":
            from miles_core.token_fields import declared_field

            for f in payload.get("token_fields", ()):
                declared_field(f)
            backend = BACKENDS.get(payload["backend"])(**payload["kwargs"])
        elif name == "close":
            backend = None
        else:
            assert backend is not None, f"trainer call {name!r} before init"
            result = getattr(backend, f"_{name}")(*payload)
            if isinstance(result, Iterator):  # e.g. named_weights: run its collectives to the end
                for _ in result:
                    pass


def shutdown() -> None:
    """Rank 0: tell the followers to exit; every rank: meet at a barrier and destroy the group
    (exiting with a live gloo group can abort the process with 'terminate called ...')."""
    if not dist.is_initialized():
        return
    announce("exit", None)
    _teardown()


def _teardown() -> None:
    global _control_group
    if dist.get_world_size() > 1:
        dist.barrier()
    dist.destroy_process_group()
    _control_group = None
