"""Copies of a trainer's own parameters at earlier policy versions, to compute a forward under
the weights a stale sample was generated with (true on-policy, `true_on_policy/behaviour.py`).

Each rank keeps its local pieces (an FSDP2 shard, a Megatron stage's tensors), so a swap moves
no data between ranks; a kept version costs one copy of the rank's parameters in memory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.distributed.tensor import DTensor


def local_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """The tensors holding `module`'s parameters on this rank (a DTensor's local shard)."""
    return [p.to_local() if isinstance(p, DTensor) else p for p in module.parameters()]


class KeptWeights:
    def __init__(self) -> None:
        self._kept: dict[int, list[torch.Tensor]] = {}

    def keep(self, version: int, module: torch.nn.Module, oldest: int) -> None:
        """Copies `module`'s parameters as `version` (once) and forgets versions before `oldest`."""
        for v in [v for v in self._kept if v < oldest]:
            del self._kept[v]
        if version not in self._kept:
            with torch.no_grad():
                self._kept[version] = [t.detach().clone() for t in local_tensors(module)]

    def __contains__(self, version: int) -> bool:
        return version in self._kept

    def versions(self) -> list[int]:
        return sorted(self._kept)

    @contextlib.contextmanager
    def swapped_in(self, version: int, module: torch.nn.Module) -> Iterator[None]:
        """`module` computes with the parameters kept as `version`, then gets its own back."""
        tensors = local_tensors(module)
        with torch.no_grad():
            own = [t.detach().clone() for t in tensors]
            for t, kept in zip(tensors, self._kept[version], strict=True):
                t.copy_(kept)
        try:
            yield
        finally:
            with torch.no_grad():
                for t, mine in zip(tensors, own, strict=True):
                    t.copy_(mine)
