"""An adapter's term of a linear layer: y = base(x) + (dropout(x)·Aᵀ)·Bᵀ · scaling (peft's
unmerged forward), for one adapter over every row or, in an engine, each row with its own.

`linear(x, w)` is the caller's x·wᵀ, so the term is computed with the kernel the caller's
forward uses: the invariant forward's `dot` (then the trainer and the engine compute the same
bits, a row's term being its own whatever rows share the call) or a plain GEMM. A row without an
adapter gets exactly zero, so the base layer's output is unchanged for it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class LoraGroup:
    """Rows of a call that use one adapter on one module (`rows` None: every row)."""

    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scaling: float
    rows: torch.Tensor | None = None  # indices along the batch dim
    dropout: Callable[[torch.Tensor], torch.Tensor] | None = None


class LoraTerms(Protocol):
    """Where a forward gets the adapter groups of a module: the trainer's peft layers, or an
    engine's loaded adapters for the rows of the current call."""

    def groups(self, module: str) -> list[LoraGroup]: ...


Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def plain_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x, w.to(x.dtype))


def lora_term(x: torch.Tensor, groups: list[LoraGroup], linear: Linear = plain_linear):
    """The adapters' term for input x [B, ..., in] (None when no group): each group's rows get
    (dropout(x)·Aᵀ)·Bᵀ · scaling, other rows zero."""
    if not groups:
        return None
    out = None
    for g in groups:
        rows = x if g.rows is None else x.index_select(0, g.rows)
        if g.dropout is not None:
            rows = g.dropout(rows)
        term = linear(linear(rows, g.a), g.b) * g.scaling
        if g.rows is None:
            out = term if out is None else out + term
            continue
        if out is None:
            out = x.new_zeros((*x.shape[:-1], g.b.shape[0]), dtype=term.dtype)
        out = out.index_add(0, g.rows, term)
    return out
