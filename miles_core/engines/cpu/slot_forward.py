"""`BatchForward` (`batch_forward.py`) on a slot runner: anything with the serving engine's runner
interface (a `SlotKVCache` as `cache`, `prefill(slots, starts, chunks)`, `decode(slots,
positions, tokens)`, `max_len`, `invalidate()`, `verify_packed()`): Qwen3's lean runner
(`models/qwen3/runner.py`) or the invariant one (`true_on_policy/runner.py`).

Row i of a batch owns slot i of a cache sized to the largest batch and length seen so far. Each
distinct prompt is prefilled into the slot of its first row, and its keys and values are copied
into the slots of the other rows that extend it (one indexed copy per layer). Decode feeds one
token per row at that row's own position, so no row is padded.
"""

from __future__ import annotations

from typing import Any

import torch


class SlotBatchForward:
    def __init__(self, runner: Any):
        self.runner = runner
        self._positions: list[int] = []
        self._length = 0

    def prefill(self, prompts: list[list[int]], row_prompt: list[int], length: int) -> torch.Tensor:
        rows = len(row_prompt)
        self._reserve(rows, length)
        first: dict[int, int] = {}
        for row, p in enumerate(row_prompt):
            first.setdefault(p, row)
        slots = [first[p] for p in range(len(prompts))]
        logits = self.runner.prefill(slots, [0] * len(prompts), prompts)
        src = [first[p] for p in row_prompt]
        if len(prompts) < rows:
            dst = [r for r in range(rows) if src[r] != r]
            width = max(len(p) for p in prompts)
            self.runner.cache.copy_prefixes([src[r] for r in dst], dst, width)
            logits = logits[torch.tensor(row_prompt, device=logits.device)]
        self._positions = [len(prompts[p]) for p in row_prompt]
        self._length = length
        return logits

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        # a row still generating stays below `length`; one past it has finished (a short
        # limit in a batch with longer ones) and is fed at its last position, output unused
        last = self._length - 1
        positions = [min(p, last) for p in self._positions]
        logits = self.runner.decode(list(range(len(positions))), positions, tokens.tolist())
        self._positions = [p + 1 for p in self._positions]
        return logits

    def _reserve(self, rows: int, length: int) -> None:
        """A cache of at least `rows` slots of `length` positions (kept for later batches that
        fit; grown to the larger of each, `length` rounded up to a multiple of 64)."""
        r = self.runner
        cache = r.cache
        if cache.slots >= rows and cache.max_len >= length:
            return
        held = cache.max_len if cache.slots else 0
        length = min(r.max_len, max(held, -(-length // 64) * 64))
        r.cache = cache.resized(max(rows, cache.slots), length)

    def use_adapters(self, adapters) -> None:
        self.runner.lora = adapters

    def invalidate(self) -> None:
        self.runner.invalidate()

    def stale(self) -> list[str]:
        return self.runner.verify_packed()
