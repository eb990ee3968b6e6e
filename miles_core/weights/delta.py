"""Weight deltas for the disk transport: only tensors that changed since the engine's version,
each encoded against its old bytes, in the smaller of two exact encodings:

- `bitmap-int8-zlib6`: an optimizer step at a small learning rate leaves most bf16 elements
  unchanged and moves the rest by a few units in the last place. Read as integers, new − old is
  stored as a bitmap of the changed elements, their differences as int8 (−128 marks one that does
  not fit) and the raw bit patterns of those that do not fit; the first two zlib-compressed.
- `xor-shuffle-zlib1`: for fp32, where nearly every element moves by many units in the last
  place, the XOR of the old and new bytes with byte planes shuffled (the sign and exponent bytes
  of a small update are mostly zero and compress away), zlib level 1.

Applying a delta needs exactly the base it was made against, so a delta names its base version
and an engine at any other version refuses it; the decoded tensors are checked against the
manifest's sha256 of the final weights before anything is loaded.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np
import torch

ULP = "bitmap-int8-zlib6"
XOR = "xor-shuffle-zlib1"
ENCODINGS = (ULP, XOR)
_HEADER = struct.Struct("<5Q")  # elements, changed, raw, compressed bitmap, compressed diffs
_INT = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}
_ESCAPE = -128


def _ints(t: torch.Tensor) -> np.ndarray:
    """The tensor's bit patterns as int64 (new − old cannot overflow)."""
    raw = t.detach().contiguous().view(-1).view(torch.uint8).numpy()
    return raw.view(_INT[t.element_size()]).astype(np.int64)


def encode(new: torch.Tensor, old: torch.Tensor) -> tuple[str, torch.Tensor]:
    """(encoding, uint8 tensor) of the smaller delta from `old` to `new` (same dtype and size)."""
    if new.dtype != old.dtype or new.numel() != old.numel():
        raise ValueError("a delta needs two tensors of the same dtype and size")
    ulp = _encode_ulp(new, old)
    if ulp.numel() < new.numel() * new.element_size() // 4:
        return ULP, ulp  # small already: the XOR encoding would not beat it
    xor = _encode_xor(new, old)
    return (ULP, ulp) if ulp.numel() <= xor.numel() else (XOR, xor)


def decode(packed: torch.Tensor, old: torch.Tensor, encoding: str) -> torch.Tensor:
    """The new tensor from a delta and the base tensor it was made against."""
    if encoding == ULP:
        return _decode_ulp(packed, old)
    if encoding == XOR:
        return _decode_xor(packed, old)
    raise ValueError(f"unknown delta encoding {encoding!r}; known: {list(ENCODINGS)}")


def _encode_ulp(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    a, b = _ints(new), _ints(old)
    d = a - b
    changed = d != 0
    diffs = d[changed]
    fits = np.abs(diffs) <= 127
    small = np.where(fits, diffs, _ESCAPE).astype(np.int8)
    raw = a[changed][~fits].astype(_INT[new.element_size()])
    bitmap = zlib.compress(np.packbits(changed).tobytes(), 6)
    diff_stream = zlib.compress(small.tobytes(), 6)
    head = _HEADER.pack(d.size, small.size, raw.size, len(bitmap), len(diff_stream))
    blob = b"".join((head, bitmap, diff_stream, raw.tobytes()))
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8)


def _decode_ulp(packed: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    blob = packed.numpy().tobytes()
    numel, n_changed, n_raw, n_bitmap, n_diffs = _HEADER.unpack_from(blob)
    width = old.element_size()
    at = _HEADER.size
    expected = at + n_bitmap + n_diffs + n_raw * width
    if numel != old.numel() or len(blob) != expected:
        raise ValueError("delta does not match the base tensor's size")
    bits = np.frombuffer(zlib.decompress(blob[at : at + n_bitmap]), dtype=np.uint8)
    changed = np.unpackbits(bits, count=numel).astype(bool)
    at += n_bitmap
    small = np.frombuffer(zlib.decompress(blob[at : at + n_diffs]), dtype=np.int8)
    at += n_diffs
    raw = np.frombuffer(blob[at:], dtype=_INT[width])
    where = np.flatnonzero(changed)
    escaped = small == _ESCAPE
    if where.size != n_changed or small.size != n_changed or int(escaped.sum()) != n_raw:
        raise ValueError("delta streams do not agree")
    ints = _ints(old)
    values = ints[where] + small.astype(np.int64)
    values[escaped] = raw
    ints[where] = values
    out = ints.astype(_INT[width])  # every value is a bit pattern of this width
    return torch.from_numpy(out.view(np.uint8).copy()).view(old.dtype).view(old.shape)


def _planes(raw: torch.Tensor, width: int) -> torch.Tensor:
    return raw.view(-1, width).t().contiguous().view(-1)


def _unplanes(raw: torch.Tensor, width: int) -> torch.Tensor:
    return raw.view(width, -1).t().contiguous().view(-1)


def _encode_xor(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    a = new.detach().contiguous().view(-1).view(torch.uint8)
    b = old.detach().contiguous().view(-1).view(torch.uint8)
    x = _planes(torch.bitwise_xor(a, b), new.element_size())
    return torch.frombuffer(bytearray(zlib.compress(x.numpy().tobytes(), 1)), dtype=torch.uint8)


def _decode_xor(packed: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    raw = zlib.decompress(packed.numpy().tobytes())
    x = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    b = old.detach().contiguous().view(-1).view(torch.uint8)
    if x.numel() != b.numel():
        raise ValueError("delta does not match the base tensor's size")
    out = torch.bitwise_xor(_unplanes(x, old.element_size()), b)
    return out.view(old.dtype).view(old.shape)
