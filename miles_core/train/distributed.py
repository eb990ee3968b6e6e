"""torch.distributed for the trainer: one gloo process by default, N ranks under torchrun.

Under torchrun, rank 0 runs the flow and drives the trainer; the other ranks run `follow()`,
which replays every trainer call rank 0 announces (SPMD), so collectives line up.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

TIMEOUT = datetime.timedelta(seconds=int(os.environ.get("MILES_DIST_TIMEOUT_S", "600")))


def init_distributed() -> tuple[int, int]:
    """Joins the torchrun group if launched by torchrun, else makes a one-rank gloo group."""
    if not dist.is_initialized():
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
            dist.init_process_group("gloo", timeout=TIMEOUT)
        else:
            dist.init_process_group(
                "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=TIMEOUT
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


def receive() -> tuple[str, Any]:
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0, group=_control())
    return box[0]


def follow() -> None:
    """The loop of ranks > 0: build the trainer rank 0 builds, replay its calls, until 'exit'."""
    from miles_core.train.fsdp import FSDPBackend

    backend: FSDPBackend | None = None
    while True:
        name, payload = receive()
        if name == "exit":
            _teardown()
            return
        if name == "init":
            backend = FSDPBackend(**payload)
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
