"""A slot-based KV cache: one preallocated [slots, kv_heads, max_len, head_dim] tensor pair per layer.

A sequence owns one slot while it runs; `k[layer][slot, :, :n]` are its first n positions.
Slots of finished sequences stay filled (CACHED) so a later request with the same prefix can take
the slot over, or copy the prefix, instead of recomputing it (see `prefix_cache.py`).
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
        dtype=torch.float32,
    ):
        shape = (slots, kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype) for _ in range(layers)]
        self.slots = slots
        self.max_len = max_len

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        for k, v in zip(self.k, self.v, strict=True):
            k[dst, :, :length] = k[src, :, :length]
            v[dst, :, :length] = v[src, :, :length]

    def release(self) -> None:
        """Frees the memory (release_memory_occupation); `allocate` brings it back zeroed."""
        self._shape = self.k[0].shape
        self._dtype = self.k[0].dtype
        self.k = [torch.empty(0) for _ in self.k]
        self.v = [torch.empty(0) for _ in self.v]

    def allocate(self) -> None:
        if self.k and self.k[0].numel() == 0:
            self.k = [torch.zeros(self._shape, dtype=self._dtype) for _ in self.k]
            self.v = [torch.zeros(self._shape, dtype=self._dtype) for _ in self.v]
