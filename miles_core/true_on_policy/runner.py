"""The serving engine's runner (the interface of `models/qwen3/runner.py`) on an invariant forward:
the same slot KV cache, prefill of each sequence's uncached tail and one-token decode, computed by
the model family's `InvariantModel`, so whatever the scheduler batches together, prefix reuse
included, a token's logits are the bits of the trainer's forward. Nothing is packed from the
weights: a weight update needs nothing here."""

from __future__ import annotations

import torch

from miles_core.engines.cpu.kv_cache import SlotKVCache
from miles_core.true_on_policy.forward import InvariantModel


class InvariantRunner:
    emulate_bf16 = False
    gemm_dtype = torch.float32

    def __init__(self, inv: InvariantModel, slots: int, max_len: int | None = None):
        self.inv = inv
        self.device = next(inv.model.parameters()).device
        self.max_len = min(max_len or inv.length, inv.length)
        self.routes_shape = inv.routes_shape  # MoE: each position's experts, kept per slot
        inv.record_routes = self.routes_shape is not None
        self.cache = SlotKVCache(  # in the compute dtype: the bits the forward rounded to
            inv.layers,
            slots,
            inv.kv_heads,
            self.max_len,
            inv.head_dim,
            dtype=inv.dtype,
            device=self.device,
            routes=self.routes_shape,
        )

    @property
    def lora(self):
        """The engine's adapters (lora/served.py), whose terms the invariant forward adds."""
        return self.inv.lora

    @lora.setter
    def lora(self, adapters) -> None:
        self.inv.lora = adapters

    def routes_of(self, slot: int, length: int) -> torch.Tensor | None:
        return self.cache.routes_of(slot, length)

    def invalidate(self) -> None:
        """Nothing derived from the weights."""

    def verify_packed(self) -> list[str]:
        return []

    @torch.inference_mode()
    def prefill(self, slots: list[int], starts: list[int], chunks: list[list[int]]) -> torch.Tensor:
        """Runs the uncached tail of each sequence; returns logits of each sequence's last
        token [B, V]."""
        lens = [len(c) for c in chunks]
        width = max(lens)
        ids = torch.zeros((len(slots), width), dtype=torch.long)
        positions = torch.zeros((len(slots), width), dtype=torch.long)
        for i, (s, c) in enumerate(zip(starts, chunks, strict=True)):
            ids[i, : len(c)] = torch.tensor(c)
            # past a row's own tail: positions it has not reached yet (overwritten before read)
            positions[i] = torch.arange(s, s + width).clamp(max=self.max_len - 1)
        ids, positions = ids.to(self.device), positions.to(self.device)
        logits = self.inv.logits(ids, positions, self.cache.kv, slots)
        self.cache.record_routes(slots, starts, lens, self.inv.last_routes)
        last = torch.tensor([n - 1 for n in lens], device=self.device)
        return logits[torch.arange(len(slots), device=self.device), last]

    @torch.inference_mode()
    def decode(self, slots: list[int], positions: list[int], tokens: list[int]) -> torch.Tensor:
        """One new token per sequence at `positions`; returns logits [B, V]."""
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device).view(-1, 1)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device).view(-1, 1)
        logits = self.inv.logits(ids, pos, self.cache.kv, slots)[:, 0]
        self.cache.record_routes(slots, positions, [1] * len(slots), self.inv.last_routes)
        return logits


def invariant_runner(
    model: torch.nn.Module,
    slots: int,
    max_len: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> InvariantRunner:
    """The invariant runner over `model` computing in `dtype`, from its model family;
    ValueError saying why when the family has no invariant forward for it."""
    from miles_core.models.family import family_of

    family = family_of(model.config.model_type)
    if family is None:
        raise ValueError(f"no model family for {model.config.model_type!r}")
    inv = family.invariant(model)
    inv.dtype = dtype
    return InvariantRunner(inv, slots, max_len)
