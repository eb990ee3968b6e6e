"""Python rows of ids or values as one padded tensor, built in one op (the trainer's batches,
the embedded engine's left-padded prompts)."""

from __future__ import annotations

import torch


def pad_rows(
    rows: list[list[int]] | list[list[float]],
    width: int,
    pad: float,
    dtype: torch.dtype,
    left: bool = False,
) -> torch.Tensor:
    """Python rows as one [len(rows), width] tensor, right-padded (`left`: left-padded) with
    `pad`: one tensor built from all values at once, scattered by a length mask."""
    out = torch.full((len(rows), width), pad, dtype=dtype)
    lens = torch.tensor([len(r) for r in rows], dtype=torch.long)
    if rows and int(lens.max()) > width:
        raise ValueError(f"a row of {int(lens.max())} values does not fit in {width}")
    cols = torch.arange(width)
    valid = cols >= width - lens[:, None] if left else cols < lens[:, None]
    out[valid] = torch.tensor([v for r in rows for v in r], dtype=dtype)
    return out
