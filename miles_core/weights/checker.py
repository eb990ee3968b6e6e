"""Bitwise comparison of engine weights against the trainer's (the `weights_checker` compare)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch


def mismatched_tensors(
    expected: Iterable[tuple[str, torch.Tensor]], actual: dict[str, torch.Tensor]
) -> list[str]:
    """Names whose tensors are missing or not bitwise equal."""
    bad = []
    for name, tensor in expected:
        got = actual.get(name)
        if (
            got is None
            or got.shape != tensor.shape
            or got.dtype != tensor.dtype
            or not torch.equal(got, tensor)
        ):
            bad.append(name)
    return bad


def weights_checksum(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 over names and raw bytes, in name order."""
    h = hashlib.sha256()
    for name, t in sorted(named, key=lambda x: x[0]):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
