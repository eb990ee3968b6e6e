"""Trainer ranks as threads of the test process: `on_ranks` runs a function on each with a
max-reduce across them (what a trainer's all_reduce does), `row_plan` is FSDP2's split of every
tensor by rows. For the p2p tests that need several senders without torchrun."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from miles_core.weights.source import Placement, TensorPlan, dim_chunks, dtype_name


def on_ranks(world: int, fn: Callable) -> list:
    """[fn(rank, reduce) for each rank], run concurrently; `reduce(t)` max-reduces `t` over
    the ranks in place (every rank must call it the same number of times)."""
    barrier, shared, out, errors = threading.Barrier(world), [None] * world, [None] * world, []

    def reduce_for(rank: int) -> Callable[[torch.Tensor], None]:
        def reduce(t: torch.Tensor) -> None:
            shared[rank] = t.clone()
            barrier.wait()
            t.copy_(torch.stack(shared).amax(0))
            barrier.wait()

        return reduce

    def run(rank: int) -> None:
        try:
            out[rank] = fn(rank, reduce_for(rank))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return out


def row_plan(weights: dict[str, torch.Tensor], world: int) -> list[TensorPlan]:
    """FSDP2's plan: every tensor split by rows (dim 0) in torch.chunk pieces."""
    plan = []
    for name, t in weights.items():
        chunks = dim_chunks(t.shape[0], world)
        pieces = [Placement(r, 0, start, n) for r, (start, n) in enumerate(chunks)]
        plan.append(TensorPlan(name, list(t.shape), dtype_name(t.dtype), pieces))
    return plan


def local_rows(weights: dict[str, torch.Tensor], plan: list[TensorPlan], rank: int) -> dict:
    """The slices `rank` holds under `plan`, by name."""
    return {
        t.name: weights[t.name].narrow(p.dim, p.start, p.length)
        for t in plan
        for p in t.pieces
        if p.rank == rank and p.length > 0
    }
