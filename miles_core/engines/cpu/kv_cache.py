"""A slot-based KV cache: one preallocated [slots, max_len, 2·kv_heads, head_dim] tensor per layer.

A sequence owns one slot while it runs; `kv[layer][slot, :n]` are its first n positions, keys in
the first kv_heads rows and values in the rest, so one indexed write stores both.
Slots of finished sequences stay filled (CACHED) so a later request with the same prefix can take
the slot over, or copy the prefix, instead of recomputing it (see `slots.py`).

A mixture-of-experts model's cache also keeps, per slot and position, the experts each MoE layer
routed that position to (`routes`: [slots, max_len, MoE layers, top_k] int32): it moves with the
keys and values (copies, swaps), so a request that reuses a cached prefix still has the routes
of every position it holds (what the routes field returns: `models/moe.py`).
"""

from __future__ import annotations

import torch


class SlotKVCache:
    def __init__(
        self,
        layers: int,
        slots: int,
        kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        routes: tuple[int, int] | None = None,
    ):
        self._shape = (slots, max_len, 2 * kv_heads, head_dim)
        self._routes_shape = None if routes is None else (slots, max_len, *routes)
        self.routes: torch.Tensor | None = None
        self._dtype = dtype
        self._device = torch.device(device)
        self._layers = layers
        self.kv: list[torch.Tensor] = []
        self.slots = slots
        self.max_len = max_len
        self.allocate()

    def resized(self, slots: int, max_len: int) -> SlotKVCache:
        """An empty cache like this one with `slots` slots of `max_len` positions."""
        _, _, kv2, head_dim = self._shape
        routes = None if self._routes_shape is None else self._routes_shape[2:]
        return SlotKVCache(
            self._layers, slots, kv2 // 2, max_len, head_dim, self._dtype, self._device, routes
        )

    def _tensors(self) -> list[torch.Tensor]:
        """Everything indexed [slot, position]: the KV of every layer, and the routes."""
        return self.kv if self.routes is None else [*self.kv, self.routes]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors())

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        for kv in self._tensors():
            kv[dst, :length] = kv[src, :length]

    def copy_prefixes(self, src: list[int], dst: list[int], length: int) -> None:
        """`copy_prefix` for many pairs at once: one indexed copy per layer."""
        src_t = torch.tensor(src, device=self._device)
        dst_t = torch.tensor(dst, device=self._device)
        for kv in self._tensors():
            kv[dst_t, :length] = kv[src_t, :length]

    def swap(self, i: int, j: int, length: int) -> None:
        """Exchanges the first `length` positions of slots i and j."""
        for kv in self._tensors():
            held = kv[i, :length].clone()
            kv[i, :length] = kv[j, :length]
            kv[j, :length] = held

    def routes_of(self, slot: int, length: int) -> torch.Tensor | None:
        """The routes of a slot's first `length` positions [length, MoE layers, top_k] (CPU
        int32), or None for a dense model or a released cache."""
        return None if self.routes is None else self.routes[slot, :length].cpu()

    def record_routes(
        self, slots: list[int], starts: list[int], lens: list[int], routes: torch.Tensor | None
    ) -> None:
        """Keeps `routes` [B, T, MoE layers, top_k], a forward's experts: row i's first
        `lens[i]` positions at positions `starts[i]`… of slot `slots[i]` (nothing for a dense
        model or a released cache)."""
        if self.routes is None or routes is None:
            return
        routes = routes.to(torch.int32)
        if all(n == 1 for n in lens):  # a decode step: one indexed write
            index = torch.tensor(slots, device=self._device)
            at = torch.tensor(starts, device=self._device)
            self.routes[index, at] = routes[:, 0]
            return
        for i, (slot, s, n) in enumerate(zip(slots, starts, lens, strict=True)):
            self.routes[slot, s : s + n] = routes[i, :n]

    def release(self) -> None:
        """Frees the memory (release_memory_occupation); `allocate` brings it back zeroed."""
        self.kv = []
        self.routes = None

    def allocate(self) -> None:
        if not self.kv:
            self.kv = [
                torch.zeros(self._shape, dtype=self._dtype, device=self._device)
                for _ in range(self._layers)
            ]
            if self._routes_shape is not None:
                self.routes = torch.zeros(
                    self._routes_shape, dtype=torch.int32, device=self._device
                )
