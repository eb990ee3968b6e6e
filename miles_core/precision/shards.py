"""p2p pushes of quantized weights: every trainer rank quantizes the rows of each weight it
holds, with the statistics of the whole weight (a per-tensor amax, a block grid) max-reduced
over the trainer ranks, so nothing is gathered and the bytes are `QuantPlan.export`'s.

A weight's row parts (its quantized elements, per-row block scales) travel as its rows did;
the parts that describe the whole weight (a tensor scale, a block grid, INT4's shape) come
from the rank holding its first rows. A fused expert tensor, sharded by expert, sends each
expert's weights whole from the rank that holds that expert."""

from __future__ import annotations

from collections.abc import Callable

import torch

from miles_core.precision.plan import QuantPlan, partner, pieces, prefix_of
from miles_core.weights.source import Placement, ShardPlan, TensorPlan, dtype_name

Reduce = Callable[[torch.Tensor], None]  # max-reduces a tensor over the trainer ranks, in place


def _owner(t: TensorPlan, row: int) -> int:
    """The rank holding row `row` of dim 0."""
    return next(p.rank for p in t.pieces if p.start <= row < p.start + p.length)


def quantized_shards(
    plan: QuantPlan,
    floats: ShardPlan,
    local: dict[str, torch.Tensor] | None = None,
    rank: int = 0,
    reduce: Reduce | None = None,
) -> tuple[ShardPlan, dict[int, torch.Tensor]]:
    """(what a p2p push sends, in order; this rank's pieces {index in it: tensor}) for the
    float tensors of `floats`. `local`: this rank's slice of each of them by name (float32 for
    the quantized ones), None for the plan alone (no collectives). Every rank must call it with
    the same `floats`: the reductions run in its order."""
    fmt = plan.fmt
    out: ShardPlan = []
    mine: dict[int, torch.Tensor] = {}
    for t in floats:
        shape = tuple(t.shape)
        if not plan.quantized(t.name, shape):
            if local is not None and t.name in local:
                mine[len(out)] = local[t.name]
            out.append(t)
            continue
        if any(p.dim != 0 for p in t.pieces):
            raise ValueError(f"{t.name}: quantized p2p pushes need weights split by rows")
        ps = pieces(t.name, shape)
        if ps is not None:  # fused experts: each expert's weights whole from its rank
            for piece in ps:
                owner = _owner(t, piece.expert)
                rows_shape = (piece.stop - piece.start, shape[2])
                parts = None
                if local is not None and owner == rank:
                    held = next(p for p in t.pieces if p.rank == rank and p.length > 0)
                    w = local[t.name][piece.expert - held.start]
                    amax = None
                    if fmt.shares_amax:  # gate and up of one expert: the fused rows' amax
                        amax = w.float().abs().amax()
                    parts = fmt.quantize(w[piece.start : piece.stop], amax)
                for k, (s, dt) in fmt.parts(rows_shape).items():
                    if parts is not None:
                        mine[len(out)] = parts[k]
                    whole = [Placement(owner, 0, 0, s[0] if s else 1)]
                    out.append(
                        TensorPlan(prefix_of(piece.name) + k, list(s), dtype_name(dt), whole)
                    )
            continue
        held = [p for p in t.pieces if p.rank == rank and p.length > 0]
        first = min((p for p in t.pieces if p.length > 0), key=lambda p: p.start).rank
        parts = None
        if local is not None:
            start = held[0].start if held else 0
            rows = local[t.name] if held else torch.zeros(0, shape[1])
            stats = fmt.stats(rows, start, shape)
            other = partner(t.name) if fmt.shares_amax else None
            if stats is not None and other is not None and other in local:
                other_rows = local[other] if held else torch.zeros(0, shape[1])
                stats = torch.maximum(stats, fmt.stats(other_rows, start, shape))
            if stats is not None and reduce is not None:
                reduce(stats)
            if held:
                parts = fmt.quantize_rows(rows, start, shape, stats)
        for k, (s, dt) in fmt.parts(shape).items():
            if k in fmt.row_parts:
                placed = [Placement(p.rank, 0, p.start, p.length) for p in t.pieces]
            else:
                placed = [Placement(first, 0, 0, s[0] if s else 1)]
            if parts is not None and (k in fmt.row_parts or rank == first):
                mine[len(out)] = parts[k]
            out.append(TensorPlan(prefix_of(t.name) + k, list(s), dtype_name(dt), placed))
    return out, mine
