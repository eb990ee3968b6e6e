"""How weights leave a trainer: the contract every trainer backend offers the transports.

Two shapes, one per kind of transport:

- HF-named full tensors in buckets (`named_weights`), gathered on the trainer's rank 0: what the
  colocated, shared-memory, disk and broadcast transports send;
- per-rank shards with a placement plan (`shard_plan` + `join_group` / `send_shards`): every
  trainer rank sends what it holds, no gather. The plan says, for each HF name, the full shape,
  the dtype sent and the (dim, start, length) slice each trainer rank holds; the engine assembles
  full tensors from the plan. FSDP2 shards along dim 0; tensor-parallel shards use other dims.

`TensorBuckets` is a plain-buckets source for tests and benchmarks (no trainer behind it).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

Bucket = list[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class Placement:
    """Trainer rank `rank` holds `full.narrow(dim, start, length)` of a tensor."""

    rank: int
    dim: int
    start: int
    length: int


@dataclass(frozen=True)
class TensorPlan:
    name: str  # HF name
    shape: list[int]  # full shape
    dtype: str  # as sent ("float32", "bfloat16", …)
    pieces: list[Placement]  # in send order; empty slices (length 0) are not sent

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "pieces": [[p.rank, p.dim, p.start, p.length] for p in self.pieces],
        }

    @classmethod
    def from_json(cls, data: dict) -> TensorPlan:
        return cls(
            str(data["name"]),
            [int(d) for d in data["shape"]],
            str(data["dtype"]),
            [Placement(*(int(x) for x in p)) for p in data["pieces"]],
        )


ShardPlan = list[TensorPlan]  # in the order `send_shards` sends (the tag of each is its index)


def check_plan(plan: ShardPlan, senders: int) -> None:
    """Every piece comes from a sender rank, and the pieces of a tensor tile it along one dim
    without gaps or overlaps (a plan the engine can assemble)."""
    for t in plan:
        pieces = sorted(t.pieces, key=lambda p: p.start)
        dims = {p.dim for p in pieces}
        if not t.shape:  # a scalar: one piece of length 1 on dim 0
            if [(p.start, p.length) for p in pieces] != [(0, 1)]:
                raise ValueError(f"{t.name}: a scalar needs exactly one piece")
        elif len(dims) != 1 or not 0 <= next(iter(dims)) < len(t.shape):
            raise ValueError(f"{t.name}: pieces must split one dim of shape {t.shape}")
        else:
            at = 0
            for p in pieces:
                if p.start != at or p.length < 0:
                    raise ValueError(f"{t.name}: pieces do not tile shape {t.shape} ({p})")
                at += p.length
            if at != t.shape[pieces[0].dim]:
                raise ValueError(f"{t.name}: pieces cover {at} of {t.shape[pieces[0].dim]} rows")
        for p in pieces:
            if not 0 <= p.rank < senders:
                raise ValueError(f"{t.name}: piece from rank {p.rank}, not one of {senders}")


def dim_chunks(size: int, world: int) -> list[tuple[int, int]]:
    """(start, length) per rank of `torch.chunk(size, world)`: ceil-sized chunks, trailing ranks
    may hold none (how FSDP2's `Shard(dim)` splits a parameter)."""
    step = -(-size // world) if size else 0
    out = []
    for r in range(world):
        a, b = min(r * step, size), min((r + 1) * step, size)
        out.append((a, b - a))
    return out


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# the dtypes a push may carry, by name: float weights, and the quantized tensors and scales of
# rollout.precision (E4M3, packed FP4 and E8M0 bytes, packed INT4 words)
WIRE_DTYPES = {
    dtype_name(dt): dt
    for dt in (
        torch.float32,
        torch.bfloat16,
        torch.float16,
        torch.float64,
        torch.int64,
        torch.int32,
        torch.uint8,
        torch.float8_e4m3fn,
    )
}


def wire_view(t: torch.Tensor) -> torch.Tensor:
    """`t` as a collective can move it: gloo has no float8, so its bytes as uint8."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def full_tensor_buckets(
    params: list[tuple[str, torch.Tensor]],
    rank: int,
    bucket_bytes: int,
    dtype: torch.dtype | None = None,
) -> Iterator[Bucket]:
    """Buckets of the full tensors of `params` (plain or FSDP2 `DTensor`s) on rank 0, cast to
    `dtype` if given. Every rank runs one all-gather per sharded tensor, so if rank 0's consumer
    stops early (an error mid-push), the rest are still run in `finally`: the other ranks never
    wait in a collective that rank 0 skipped."""
    from torch.distributed.tensor import DTensor

    done = 0
    bucket: Bucket = []
    size = 0
    try:
        with torch.no_grad():
            for name, param in params:
                full = param.full_tensor() if isinstance(param, DTensor) else param.detach()
                done += 1
                if rank != 0:
                    continue
                if dtype is not None:
                    full = full.to(dtype)
                bucket.append((name, full))
                size += full.numel() * full.element_size()
                if size >= bucket_bytes:
                    yield bucket
                    bucket, size = [], 0
        if bucket:
            yield bucket
    finally:
        with torch.no_grad():
            for _, param in params[done:]:
                if isinstance(param, DTensor):
                    param.full_tensor()


class TrainerWeights(Protocol):
    """What a trainer backend offers the weight transports (part of `TrainerBackend`)."""

    world: int  # trainer ranks

    def named_weights(
        self, bucket_bytes: int = 64 << 20, dtype: torch.dtype | None = None
    ) -> Iterator[Bucket]:
        """Buckets of full HF-named tensors (rank 0; the other ranks join the gathers). Consume
        every bucket: each one is a collective on the trainer's ranks."""
        ...

    def shard_plan(
        self, dtype: torch.dtype | None = None, precision: dict | None = None
    ) -> ShardPlan:
        """Which slice of every tensor each trainer rank holds, in `send_shards` order; with
        `precision` (a QuantPlan spec), quantized weights as their parts."""
        ...

    def join_group(self, group: dict) -> None:
        """Every trainer rank joins the weight group {host, port, world, backend} as its rank."""
        ...

    def send_shards(
        self, engine_ranks: list[int], dtype: torch.dtype | None = None, precision=None
    ) -> int:
        """Every trainer rank sends its pieces of the plan to each engine rank; returns the bytes
        rank 0 sent."""
        ...


class TensorBuckets:
    """A source of given buckets (tests, benchmarks): `named_weights` yields them, cast to the
    push dtype if one is set. It has no shards: the p2p transport refuses it."""

    world = 1

    def __init__(self, buckets: Iterable[Bucket] | dict[str, torch.Tensor], per: int = 0):
        if isinstance(buckets, dict):  # a flat dict: buckets of `per` tensors (0: one bucket)
            items = list(buckets.items())
            size = per or max(len(items), 1)
            buckets = [items[i : i + size] for i in range(0, len(items), size)]
        self.buckets = [list(b) for b in buckets]

    def named_weights(
        self, bucket_bytes: int = 64 << 20, dtype: torch.dtype | None = None
    ) -> Iterator[Bucket]:
        for b in self.buckets:
            yield [(n, t if dtype is None else t.to(dtype)) for n, t in b]

    def shard_plan(
        self, dtype: torch.dtype | None = None, precision: dict | None = None
    ) -> ShardPlan:
        raise TypeError("plain buckets have no shards; p2p needs a trainer backend as the source")

    def join_group(self, group: dict) -> None:
        self.shard_plan()

    def send_shards(
        self, engine_ranks: list[int], dtype: torch.dtype | None = None, precision=None
    ) -> int:
        self.shard_plan()
        return 0
