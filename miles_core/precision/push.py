"""Pushes of quantized weights: a trainer's weights source (weights/source.py) seen through the
run's plan, so every transport sends what the engines hold — a quantized weight's parts with
its checkpoint names (`weight`, `weight_scale_inv`, …), quantized from the trainer's float
values — and nothing else changes for the transport. Bucket transports get the parts from
`named_weights`; p2p asks every trainer rank to quantize its own rows (precision/shards.py)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from miles_core.precision.plan import QuantPlan
from miles_core.weights.source import Bucket, ShardPlan, TrainerWeights


class QuantizedSource:
    def __init__(self, inner: TrainerWeights, plan: QuantPlan):
        self.inner = inner
        self.plan = plan
        self.world = inner.world
        self.part_names: set[str] = set()  # the quantized tensors it produced, by name

    def named_weights(
        self, bucket_bytes: int = 64 << 20, dtype: torch.dtype | None = None
    ) -> Iterator[Bucket]:
        """The inner buckets (float, gathered as usual), quantized weights replaced by their
        parts; `dtype` rounds only the tensors left unquantized."""
        plain: set[str] = set()

        def floats() -> Iterator[Bucket]:
            for b in self.inner.named_weights(bucket_bytes):
                plain.update(n for n, t in b if not self.plan.quantized(n, t.shape))
                yield b

        for bucket in self.plan.export_buckets(floats(), dtype):
            self.part_names.update(n for n, _ in bucket if n not in plain)
            yield bucket

    def shard_plan(self, dtype: torch.dtype | None = None) -> ShardPlan:
        return self.inner.shard_plan(dtype, precision=self.plan.spec)

    def join_group(self, group: dict) -> None:
        self.inner.join_group(group)

    def send_shards(self, engine_ranks: list[int], dtype: torch.dtype | None = None) -> int:
        return self.inner.send_shards(engine_ranks, dtype, precision=self.plan.spec)
