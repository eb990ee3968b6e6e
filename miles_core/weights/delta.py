"""Weight deltas for the disk transport: only tensors that changed since the engine's version,
each as XOR against the old bytes, byte-planes shuffled (sign/exponent bytes of a small update
are mostly zero and compress away), zlib level 1.

XOR is an involution: applying a delta needs exactly the base bytes it was made against, so a
delta names its base version and an engine at any other version refuses it; the decoded tensors
are checked against the manifest's sha256 of the final weights before anything is loaded.
"""

from __future__ import annotations

import zlib

import torch

ENCODING = "xor-shuffle-zlib1"


def _planes(raw: torch.Tensor, width: int) -> torch.Tensor:
    return raw.view(-1, width).t().contiguous().view(-1)


def _unplanes(raw: torch.Tensor, width: int) -> torch.Tensor:
    return raw.view(width, -1).t().contiguous().view(-1)


def encode(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """uint8 tensor holding the compressed XOR of the two tensors' bytes."""
    a = new.detach().contiguous().view(torch.uint8).view(-1)
    b = old.detach().contiguous().view(torch.uint8).view(-1)
    x = _planes(torch.bitwise_xor(a, b), new.element_size())
    packed = zlib.compress(x.numpy().tobytes(), 1)
    return torch.frombuffer(bytearray(packed), dtype=torch.uint8)


def decode(packed: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """The new tensor from a delta and the base tensor it was made against."""
    raw = zlib.decompress(packed.numpy().tobytes())
    x = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    b = old.detach().contiguous().view(torch.uint8).view(-1)
    if x.numel() != b.numel():
        raise ValueError("delta does not match the base tensor's size")
    out = torch.bitwise_xor(_unplanes(x, old.element_size()), b)
    return out.view(old.dtype).view(old.shape)
