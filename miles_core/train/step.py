"""The step loop every backend shares: data-parallel sharding, micro-batching, global loss
denominators, the `× world` factor, metric reduction.

A backend supplies only what differs between FSDP2 and Megatron (`StepBackend`): how a
micro-batch goes through the model, how the micro-batches of a step are scheduled
(`forward_backward`: one after the other here, through the pipeline stages in Megatron), backward,
and the optimizer step. Losses are divided by the *global* token (or sequence, or rollout) count
and multiplied by the data-parallel world size, because the gradient reduction averages over
data-parallel ranks: N ranks compute the same update as one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import torch
import torch.distributed as dist

from miles_core.train.batch import TrainBatch
from miles_core.train.forward import LossNeeds, MicroBatch, TokenOutputs
from miles_core.train.loss import LOSSES, loss_options

# called with each micro-batch's outputs where they exist (the last pipeline stage); returns the
# micro-batch's loss to backpropagate (a train step) or None (a forward-only pass)
OnOutput = Callable[[MicroBatch, TokenOutputs], "torch.Tensor | None"]


class StepBackend(Protocol):
    dp_rank: int  # data-parallel rank and size: how the global batch is split
    dp_world: int
    # whether this rank's loss statistics count in the step's metrics (one rank per
    # data-parallel replica: Megatron's tensor-parallel ranks compute copies)
    reports_stats: bool
    micro_batch_size: int
    device: torch.device

    def micro_batch(self, batch: TrainBatch) -> MicroBatch: ...

    def forward_backward(
        self, parts: list[TrainBatch], needs: LossNeeds, on_output: OnOutput, train: bool
    ) -> None:
        """Every micro-batch forward (and backward on `on_output`'s loss when `train`);
        `sequential` is the plain schedule."""
        ...

    def forward(self, mb: MicroBatch, needs: LossNeeds) -> TokenOutputs:
        """The policy's per-token outputs (with gradient unless under `torch.no_grad`)."""
        ...

    def backward(self, loss: torch.Tensor) -> None: ...

    def set_training(self, training: bool) -> None: ...

    def take_stats(self) -> dict[str, float]:
        """This rank's forwards' own counts since the last call (e.g. the routing checker's),
        summed over ranks into the step's metrics like the loss statistics."""
        ...

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


def sequential(
    backend: StepBackend,
    parts: list[TrainBatch],
    needs: LossNeeds,
    on_output: OnOutput,
    train: bool,
) -> None:
    """The plain schedule: each micro-batch forward, then backward (gradients accumulate)."""
    for part in parts:
        mb = backend.micro_batch(part)
        loss = on_output(mb, backend.forward(mb, needs))
        if train and loss is not None:
            backend.backward(loss)


def compute_log_probs(backend: StepBackend, batch: TrainBatch) -> list[list[float]]:
    """Per-sample response log-probs under the current weights; rank 0 gets every row."""
    local = shard(batch, backend.dp_rank, backend.dp_world)
    rows: list[list[float]] | None = None

    def collect(mb: MicroBatch, out: TokenOutputs) -> None:
        nonlocal rows
        rows = (rows or []) + mb.padded.unpad(out.log_probs, mb.batch.response_lengths)

    with torch.no_grad():
        parts = list(micro_batches(local, backend.micro_batch_size))
        backend.forward_backward(parts, LossNeeds(), collect, train=False)
    backend.take_stats()  # what this pass counted is not a training step's
    return gather_rows(rows, backend.dp_rank)[: len(batch)]  # without `shard`'s inert rows


def train_step(
    backend: StepBackend, batch: TrainBatch, loss: str, settings: Mapping[str, Any]
) -> dict[str, float]:
    """One optimizer step over the global batch with the loss registered as `loss`."""
    fn = LOSSES.get(loss)
    cfg = fn.config(loss_options(settings, loss))
    needs = fn.needs(cfg)
    backend.set_training(True)
    local = shard(batch, backend.dp_rank, backend.dp_world)
    agg = fn.aggregation(cfg)
    global_tokens = float(sum(sum(m) for m in batch.loss_masks))
    denom = max(global_tokens, 1.0) if agg == "token_mean" else float(len(batch))
    if agg == "rollout_mean_token_mean":  # totals over the global batch, then shard
        batch, rollouts = batch.with_rollout_tokens()
        local, denom = shard(batch, backend.dp_rank, backend.dp_world), float(rollouts)
    sums: dict[str, float] = {}

    def loss_of(mb: MicroBatch, out: TokenOutputs) -> torch.Tensor:
        mb_loss, stats = fn(out, mb, cfg, denom)
        for k, v in stats.items():
            sums[k] = sums.get(k, 0.0) + v
        return mb_loss * backend.dp_world

    parts = list(micro_batches(local, backend.micro_batch_size))
    backend.forward_backward(parts, needs, loss_of, train=True)
    step = backend.optimizer_step()
    backend.set_training(False)
    own = backend.take_stats()  # every rank's (the loss statistics: the reporting ranks')
    metrics = reduce_stats((sums if backend.reports_stats else {}) | own, global_tokens)
    metrics.update(step)
    return metrics


def reduce_stats(sums: dict[str, float], global_tokens: float) -> dict[str, float]:
    """Sums each stat over every rank that computed a loss (the others hold none: a pipeline's
    earlier stages); `_x` token sums become `x` per global token; `x__num` / `x__den` sums
    become their ratio `x` (a rate over something other than loss tokens)."""
    total: dict[str, float] = {}
    for part in _gather(sums):
        for k, v in part.items():
            total[k] = total.get(k, 0.0) + v
    out = {}
    for k in sorted(total):
        if k.endswith("__den"):
            continue
        if k.endswith("__num"):
            den = total.get(k[: -len("__num")] + "__den", 0.0)
            out[k[: -len("__num")]] = total[k] / den if den else 0.0
        elif k.startswith("_"):
            out[k[1:]] = total[k] / max(global_tokens, 1.0)
        else:
            out[k] = total[k]  # already normalised by the global denominator
    return out


def gather_rows(rows: list[list[float]] | None, dp_rank: int) -> list[list[float]]:
    """Every data-parallel rank's rows in rank order, from the ranks that hold them (`None`
    elsewhere: a pipeline's earlier stages; tensor-parallel ranks hold copies, one is kept)."""
    held = {r: part for r, part in _gather((dp_rank, rows)) if part is not None}
    return [row for r in sorted(held) for row in held[r]]


def _gather(obj: Any) -> list[Any]:
    """`obj` from every rank of the default group (one object round)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, obj)
    return parts
