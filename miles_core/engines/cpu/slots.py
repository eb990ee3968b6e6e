"""Slot bookkeeping with prefix reuse for the serving engine.

Every KV-cache slot is FREE, RUNNING (owned by a request) or CACHED (holding the KV of a finished
or retracted sequence). A new request is matched against the token prefixes of RUNNING and CACHED
slots: a CACHED slot with the longest common prefix is taken over in place (zero copy); a RUNNING
one has its prefix copied into a fresh slot. Eviction: least recently used CACHED slot.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class SlotState(Enum):
    FREE = 0
    RUNNING = 1
    CACHED = 2


@dataclass
class Slot:
    index: int
    state: SlotState = SlotState.FREE
    tokens: list[int] = field(default_factory=list)  # tokens whose KV is valid in this slot
    last_used: int = 0
    epoch: int = 0  # the weights epoch its KV was computed with
    adapter: str | None = None  # the LoRA adapter its KV was computed with (None: the base)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # one C-level compare for the common case (GRPO siblings)
        return n
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class SlotTable:
    def __init__(self, n: int, min_match: int = 1):
        self.slots = [Slot(i) for i in range(n)]
        self.min_match = min_match
        self._clock = 0
        self.epoch = 0

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def best_match(
        self, tokens: list[int], exclude: set[int], adapter: str | None = None
    ) -> tuple[Slot | None, int]:
        """The RUNNING or CACHED slot sharing the longest prefix with `tokens` (at most len-1, so
        the last token is always computed and yields logits), computed with the same adapter."""
        limit = len(tokens) - 1
        best, best_len = None, 0
        first = tokens[0] if tokens else None
        for s in self.slots:
            if (
                s.epoch != self.epoch
                or s.state == SlotState.FREE
                or s.index in exclude
                or not s.tokens
                or s.tokens[0] != first
                or s.adapter != adapter
            ):
                continue
            if best_len:
                # one token decides most slots: a slot changes the answer only with a longer
                # match (token best_len equal) or, if CACHED, an equal one (token best_len-1
                # equal); a slot that fails its check cannot, so it needs no full compare
                k = best_len - 1 if s.state == SlotState.CACHED else best_len
                if k >= limit or len(s.tokens) <= k or s.tokens[k] != tokens[k]:
                    continue
            n = min(common_prefix(s.tokens, tokens), limit)
            if n > best_len or (n == best_len and best is not None and s.state == SlotState.CACHED):
                best, best_len = s, n
        if best_len < self.min_match:
            return None, 0
        return best, best_len

    def allocate(self) -> Slot | None:
        free = [s for s in self.slots if s.state == SlotState.FREE]
        if free:
            slot = free[0]
        else:
            cached = [s for s in self.slots if s.state == SlotState.CACHED]
            if not cached:
                return None
            slot = min(cached, key=lambda s: s.last_used)
        slot.state, slot.tokens, slot.last_used = SlotState.RUNNING, [], self._tick()
        slot.epoch = self.epoch
        return slot

    def take(self, slot: Slot) -> Slot:
        slot.state, slot.last_used = SlotState.RUNNING, self._tick()
        return slot

    def park(self, slot: Slot, tokens: list[int]) -> None:
        """A sequence left the slot; its KV stays reusable if computed with the current weights."""
        if slot.epoch != self.epoch:
            slot.state, slot.tokens = SlotState.FREE, []
            return
        slot.state, slot.tokens, slot.last_used = SlotState.CACHED, list(tokens), self._tick()

    def new_epoch(self, flush: bool = True) -> None:
        """The weights changed: KV computed before (cached or still running) is never matched
        again; with `flush`, cached slots are freed now."""
        self.epoch += 1
        if flush:
            self.flush()

    def flush(self) -> None:
        """Drops every cached prefix (after a weight update the KV is stale)."""
        for s in self.slots:
            if s.state == SlotState.CACHED:
                s.state, s.tokens = SlotState.FREE, []

    def swap(self, a: Slot, b: Slot) -> None:
        """Exchanges the positions of two slots; each keeps its state and tokens (the caller
        moves the KV rows with `SlotKVCache.swap`)."""
        ia, ib = a.index, b.index
        a.index, b.index = ib, ia
        self.slots[ia], self.slots[ib] = b, a

    def count(self, state: SlotState) -> int:
        return sum(s.state == state for s in self.slots)
