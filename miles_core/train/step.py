"""The step loop every backend shares: data-parallel sharding, micro-batching, global loss
denominators, the `× world` factor, metric reduction.

A backend supplies only what differs between FSDP2 and Megatron (`StepBackend`): how a
micro-batch goes through the model, backward, and the optimizer step. Losses are divided by the
*global* token (or sequence, or rollout) count and multiplied by the data-parallel world size,
because the gradient reduction averages over ranks: N ranks compute the same update as one.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Protocol

import torch
import torch.distributed as dist

from miles_core.train.batch import TrainBatch
from miles_core.train.forward import LossNeeds, MicroBatch, TokenOutputs
from miles_core.train.registry import get_loss


class StepBackend(Protocol):
    rank: int  # data-parallel rank and size: how the global batch is split
    world: int
    micro_batch_size: int
    device: torch.device

    def micro_batch(self, batch: TrainBatch) -> MicroBatch: ...

    def forward(self, mb: MicroBatch, needs: LossNeeds) -> TokenOutputs:
        """The policy's per-token outputs (with gradient unless under `torch.no_grad`)."""
        ...

    def backward(self, loss: torch.Tensor) -> None: ...

    def set_training(self, training: bool) -> None: ...

    def optimizer_step(self) -> dict[str, float]:
        """Clip, step, zero the gradients, advance the LR schedule: {grad_norm, lr (before)}."""
        ...


def shard(batch: TrainBatch, rank: int, world: int) -> TrainBatch:
    """This rank's share of the global batch, the same number of rows on every rank (so the
    ranks' micro-batches, and their collectives, line up). A batch whose rows do not split
    evenly (an agentic batch: episodes have different numbers of leaves) gets rows that train
    nothing at its end (`TrainBatch.with_inert_rows`); a rollout's rows may then sit on two
    ranks, which the losses allow: their normalisers come from the whole batch."""
    batch = batch.with_inert_rows(-len(batch) % world)
    per = len(batch) // world
    return batch.slice(rank * per, (rank + 1) * per)


def micro_batches(batch: TrainBatch, size: int) -> Iterator[TrainBatch]:
    for start in range(0, len(batch), size):
        yield batch.slice(start, start + size)


def compute_log_probs(backend: StepBackend, batch: TrainBatch) -> list[list[float]]:
    """Per-sample response log-probs under the current weights; rank 0 gets every row."""
    local = shard(batch, backend.rank, backend.world)
    rows: list[list[float]] = []
    with torch.no_grad():
        for part in micro_batches(local, backend.micro_batch_size):
            mb = backend.micro_batch(part)
            out = backend.forward(mb, LossNeeds())
            rows.extend(mb.padded.unpad(out.log_probs, part.response_lengths))
    return gather_rows(rows, backend.world)[: len(batch)]  # without `shard`'s inert rows


def train_step(
    backend: StepBackend, batch: TrainBatch, loss: str, settings: Mapping[str, Any]
) -> dict[str, float]:
    """One optimizer step over the global batch with the loss registered as `loss`."""
    fn = get_loss(loss)
    cfg = fn.config(settings)
    needs = fn.needs(cfg)
    backend.set_training(True)
    local = shard(batch, backend.rank, backend.world)
    agg = fn.aggregation(cfg)
    global_tokens = float(sum(sum(m) for m in batch.loss_masks))
    denom = max(global_tokens, 1.0) if agg == "token_mean" else float(len(batch))
    if agg == "rollout_mean_token_mean":  # totals over the global batch, then shard
        batch, rollouts = batch.with_rollout_tokens()
        local, denom = shard(batch, backend.rank, backend.world), float(rollouts)
    sums: dict[str, float] = {}
    for part in micro_batches(local, backend.micro_batch_size):
        mb = backend.micro_batch(part)
        out = backend.forward(mb, needs)
        mb_loss, stats = fn(out, mb, cfg, denom)
        backend.backward(mb_loss * backend.world)
        for k, v in stats.items():
            sums[k] = sums.get(k, 0.0) + v
    step = backend.optimizer_step()
    backend.set_training(False)
    metrics = reduce_stats(sums, global_tokens, backend.world, backend.device)
    metrics.update(step)
    return metrics


def reduce_stats(
    sums: dict[str, float], global_tokens: float, world: int, device: torch.device
) -> dict[str, float]:
    """Sums each stat over the ranks; `_x` token sums become `x` per global token."""
    keys = sorted(sums)
    t = torch.tensor([sums[k] for k in keys], dtype=torch.float64)
    if world > 1:
        if device.type != "cpu":  # nccl reduces device tensors only
            t = t.to(device)
        dist.all_reduce(t)
    out = {}
    for k, v in zip(keys, t.tolist(), strict=True):
        if k.startswith("_"):
            out[k[1:]] = v / max(global_tokens, 1.0)
        else:
            out[k] = v  # already normalised by the global denominator
    return out


def gather_rows(rows: list[list[float]], world: int) -> list[list[float]]:
    if world == 1:
        return rows
    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, rows)
    return [r for part in parts for r in part]
