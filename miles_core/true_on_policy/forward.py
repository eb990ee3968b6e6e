"""What a model family's invariant forward provides (`InvariantModel`, from
`ModelFamily.invariant`). The engines run it through the invariant runner (`runner.py`; the
embedded engine through `engines/cpu/slot_forward.py` on that runner).

`InvariantModel.logits(ids, positions, kv, slots)` computes the logits of `ids` at absolute
`positions`; with a slot KV cache (`engines/cpu/kv_cache.py`: a sequence's position p at row p
of its slot) it writes the call's keys and values there and attends to the slot's rows, without
it it attends to the call's own (sequences starting at position 0, the trainer's forward, which
`install` routes `model(input_ids=...)` through).
"""

from __future__ import annotations

from typing import Protocol

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
