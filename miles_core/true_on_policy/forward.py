"""What a model family's invariant forward provides (`InvariantModel`, from
`ModelFamily.invariant`), and the embedded engine's `BatchForward` on it.

`InvariantModel.logits(ids, positions, kv, slots)` computes the logits of `ids` at absolute
`positions`; with a slot KV cache (`engines/cpu/kv_cache.py`: a sequence's position p at row p
of its slot) it writes the call's keys and values there and attends to the slot's rows, without
it it attends to the call's own (sequences starting at position 0, the trainer's forward, which
`install` routes `model(input_ids=...)` through).
"""

from __future__ import annotations

from typing import Protocol

import torch

from miles_core.engines.cpu.kv_cache import SlotKVCache


class InvariantModel(Protocol):
    length: int  # keys are laid out over this many positions (the model's context)
    layers: int
    kv_heads: int
    head_dim: int
    model: torch.nn.Module

    def logits(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        kv: list[torch.Tensor] | None = None,
        slots: list[int] | None = None,
    ) -> torch.Tensor: ...

    def install(self) -> None: ...


class InvariantBatchForward:
    """`BatchForward` (`engines/cpu/batch_forward.py`) on an invariant forward: row i of a batch
    owns slot i of a slot KV cache; each distinct prompt is prefilled once, in its first row's
    slot, and copied to the other rows that extend it; decode feeds one token per row at that
    row's own position. Nothing is derived from the weights."""

    def __init__(self, inv: InvariantModel):
        self.inv = inv
        self.cache: SlotKVCache | None = None
        self._positions: list[int] = []
        self._length = 0

    def prefill(self, prompts: list[list[int]], row_prompt: list[int], length: int) -> torch.Tensor:
        rows = len(row_prompt)
        cache = self._reserve(rows)
        first: dict[int, int] = {}
        for row, p in enumerate(row_prompt):
            first.setdefault(p, row)
        width = max(len(p) for p in prompts)
        device = cache.kv[0].device
        ids = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p, device=device)
        positions = torch.arange(width, device=device).expand(len(prompts), width)
        slots = [first[p] for p in range(len(prompts))]
        logits = self.inv.logits(ids, positions, cache.kv, slots)
        last = torch.tensor([len(p) - 1 for p in prompts], device=device)
        logits = logits[torch.arange(len(prompts), device=device), last]
        for row, p in enumerate(row_prompt):
            if first[p] != row:
                cache.copy_prefix(first[p], row, len(prompts[p]))
        self._positions = [len(prompts[p]) for p in row_prompt]
        self._length = length
        return logits[torch.tensor(row_prompt, device=device)]

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        # a row past its own limit has finished: fed at its last position, its output unused
        last = min(self._length, self.inv.length) - 1
        positions = torch.tensor([[min(p, last)] for p in self._positions])
        cache = self.cache
        assert cache is not None
        rows = list(range(len(self._positions)))
        logits = self.inv.logits(tokens.view(-1, 1), positions, cache.kv, rows)
        self._positions = [p + 1 for p in self._positions]
        return logits[:, 0]

    def _reserve(self, rows: int) -> SlotKVCache:
        """A cache of at least `rows` slots, each the model's whole context (kept for later
        batches that fit)."""
        if self.cache is None or self.cache.slots < rows:
            device = next(self.inv.model.parameters()).device
            self.cache = SlotKVCache(
                self.inv.layers,
                rows,
                self.inv.kv_heads,
                self.inv.length,
                self.inv.head_dim,
                device=device,
            )
        return self.cache

    def invalidate(self) -> None:
        """Nothing derived from the weights."""

    def stale(self) -> list[str]:
        return []
