"""What a model family's invariant forward provides (`InvariantModel`, from
`ModelFamily.invariant`), and the embedded engine's `BatchForward` on it.

`InvariantModel.logits(ids, positions, kv, slots)` computes the logits of `ids` at absolute
`positions`; with a slot KV cache (`engines/cpu/kv_cache.py`: a sequence's position p at row p
of its slot) it writes the call's keys and values there and attends to the slot's rows, without
it it attends to the call's own (sequences starting at position 0, the trainer's forward, which
`install` routes `model(input_ids=...)` through).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class InvariantModel(Protocol):
    length: int  # the most positions it computes (the model's context)
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
    """`BatchForward` (`engines/cpu/batch_forward.py`) on an invariant forward, through the
    serving engine's invariant runner (`runner.py`): row i of a batch owns slot i; each distinct
    prompt is prefilled once, in its first row's slot, and copied to the other rows that extend
    it; decode feeds one token per row at that row's own position."""

    def __init__(self, runner: Any):  # an `InvariantRunner`
        self.runner = runner
        self._positions: list[int] = []
        self._length = 0

    def prefill(self, prompts: list[list[int]], row_prompt: list[int], length: int) -> torch.Tensor:
        rows = len(row_prompt)
        if self.runner.cache.slots < rows:  # kept for later batches that fit
            self.runner = type(self.runner)(self.runner.inv, slots=rows)
        first: dict[int, int] = {}
        for row, p in enumerate(row_prompt):
            first.setdefault(p, row)
        logits = self.runner.prefill(
            [first[p] for p in range(len(prompts))], [0] * len(prompts), prompts
        )
        for row, p in enumerate(row_prompt):
            if first[p] != row:
                self.runner.cache.copy_prefix(first[p], row, len(prompts[p]))
        self._positions = [len(prompts[p]) for p in row_prompt]
        self._length = length
        return logits[torch.tensor(row_prompt, device=logits.device)]

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        # a row past its own limit has finished: fed at its last position, its output unused
        last = min(self._length, self.runner.max_len) - 1
        positions = [min(p, last) for p in self._positions]
        logits = self.runner.decode(list(range(len(positions))), positions, tokens.tolist())
        self._positions = [p + 1 for p in self._positions]
        return logits

    def invalidate(self) -> None:
        """Nothing derived from the weights."""

    def stale(self) -> list[str]:
        return []
