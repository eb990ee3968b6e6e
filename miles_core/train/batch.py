"""The trainer's input: samples flattened into token lists plus per-sample advantages.

Declared per-token fields (miles_core/token_fields.py) ride along: `TrainBatch.token_fields`
holds one array per row, `PaddedBatch.fields` the padded tensors aligned with the tokens
(`response` fields with `targets` [B, R, *shape], `sequence` fields with `input_ids`
[B, T, *shape]), padded with each field's declared value.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from miles_core.token_fields import token_field
from miles_core.train.padding import pad_rows
from miles_core.types import Sample


@dataclass
class TrainBatch:
    tokens: list[list[int]]
    response_lengths: list[int]
    loss_masks: list[list[int]]
    advantages: list[float] | None = None
    rollout_log_probs: list[list[float]] | None = None
    old_log_probs: list[list[float]] | None = None
    # the old policy (PPO's denominator) is the one this step trains: one optimizer step per
    # rollout, so π_old = π_θ before the step and the old log-probs are the training forward's
    # own, detached (`MicroBatch.old_log_probs`), with no recompute; `old_log_probs` stays None
    old_is_current: bool = False
    # true on-policy: each response token's log-prob under the weights that generated it, where
    # those are not the weights this step starts from (NaN: the token is the current weights',
    # so π_old's is its behaviour log-prob); None when every token is
    behaviour_log_probs: list[list[float]] | None = None
    temperature: float = 1.0
    sample_ids: list[str] = field(default_factory=list)  # rollout ids: siblings share one
    # per row: the loss-mask total of its whole rollout (loss_agg rollout_mean_token_mean)
    rollout_tokens: list[float] | None = None
    # declared per-token fields: name -> one array per row ([rows, *shape], token_fields.py)
    token_fields: dict[str, list[np.ndarray]] = field(default_factory=dict)
    # train.advantage_transforms: name -> options, applied per token in the policy loss
    # (train/advantage_transform.py)
    advantage_transforms: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.tokens)

    def slice(self, start: int, end: int) -> TrainBatch:
        def cut(x):
            return None if x is None else x[start:end]

        return replace(
            self,
            tokens=self.tokens[start:end],
            response_lengths=self.response_lengths[start:end],
            loss_masks=self.loss_masks[start:end],
            advantages=cut(self.advantages),
            rollout_log_probs=cut(self.rollout_log_probs),
            old_log_probs=cut(self.old_log_probs),
            behaviour_log_probs=cut(self.behaviour_log_probs),
            sample_ids=self.sample_ids[start:end],
            rollout_tokens=cut(self.rollout_tokens),
            token_fields={k: v[start:end] for k, v in self.token_fields.items()},
        )

    def with_inert_rows(self, k: int) -> TrainBatch:
        """This batch and `k` copies of its last row that train nothing: zero loss mask and
        advantage, the same rollout id and rollout total (no rollout and no loss token is
        added), so every rank can get the same number of rows (`train/step.py: shard`)."""
        if k <= 0:
            return self
        last = len(self) - 1

        def more(x, value=None):
            return None if x is None else x + [x[last] if value is None else value] * k

        return replace(
            self,
            tokens=more(self.tokens),
            response_lengths=more(self.response_lengths),
            loss_masks=more(self.loss_masks, [0] * len(self.loss_masks[last])),
            advantages=more(self.advantages, 0.0),
            rollout_log_probs=more(self.rollout_log_probs),
            old_log_probs=more(self.old_log_probs),
            behaviour_log_probs=more(self.behaviour_log_probs),
            sample_ids=more(self.sample_ids) if self.sample_ids else [],
            rollout_tokens=more(self.rollout_tokens),
            token_fields={name: more(rows) for name, rows in self.token_fields.items()},
        )

    def with_rollout_tokens(self) -> tuple[TrainBatch, int]:
        """This batch with each row's rollout loss-mask total, and the number of rollouts."""
        totals: dict[str, float] = {}
        for rid, mask in zip(self.sample_ids, self.loss_masks, strict=True):
            totals[rid] = totals.get(rid, 0.0) + float(sum(mask))
        rows = [totals[rid] for rid in self.sample_ids]
        return replace(self, rollout_tokens=rows), len(totals)

    @classmethod
    def from_samples(
        cls, samples: list[Sample], advantages: list[float] | None, temperature: float
    ) -> TrainBatch:
        return cls(
            tokens=[s.tokens for s in samples],
            response_lengths=[s.response_length for s in samples],
            loss_masks=[s.loss_mask for s in samples],
            advantages=advantages,
            rollout_log_probs=[s.rollout_log_probs for s in samples],
            temperature=temperature,
            sample_ids=[f"{s.rollout_id}" for s in samples],
            token_fields=_field_rows(samples),
        )


def _field_rows(samples: list[Sample]) -> dict[str, list[np.ndarray]]:
    """Each declared field any sample carries, one array per sample. A sample without it is
    refused, unless it trains on nothing (all-zero loss mask: a failed episode's placeholder),
    which gets pad rows."""
    names = sorted({name for s in samples for name in s.token_fields})
    out: dict[str, list[np.ndarray]] = {}
    for name in names:
        f = token_field(name)
        rows = []
        for s in samples:
            arr = s.token_fields.get(name)
            if arr is None:
                if any(s.loss_mask):
                    raise ValueError(
                        f"sample {s.rollout_id} (index {s.index}) lacks token field {name} "
                        "that other samples of the batch carry"
                    )
                n = f.rows(len(s.tokens), s.response_length)
                arr = np.full((n, *f.shape), f.pad, dtype=f.np_dtype)
            rows.append(arr)
        out[name] = rows
    return out


@dataclass
class PaddedBatch:
    """Right-padded tensors for one micro-batch, with response-aligned gather indices."""

    input_ids: torch.Tensor  # [B, T]
    targets_index: torch.Tensor  # [B, R]: position in logits predicting each response token
    targets: torch.Tensor  # [B, R]: the response token ids
    mask: torch.Tensor  # [B, R]: loss mask (0 on padding)
    # declared per-token fields: [B, R, *shape] (response-aligned) or [B, T, *shape] (sequence)
    fields: dict[str, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def build(cls, batch: TrainBatch, pad_id: int, width: int = 0) -> PaddedBatch:
        """`width`: pad the rows to at least this many positions (ranks whose collectives need
        equal shapes: Megatron's expert-parallel token exchange)."""
        width = max(width, *(len(t) for t in batch.tokens))
        resp = max(max(batch.response_lengths), 1)
        lengths = batch.response_lengths
        for i, (lm, n) in enumerate(zip(batch.loss_masks, lengths, strict=True)):
            if len(lm) != n:
                raise ValueError(f"row {i}: loss mask of {len(lm)} for {n} response tokens")
        input_ids = pad_rows(batch.tokens, width, pad_id, torch.long)
        targets = pad_rows(
            [t[len(t) - n :] if n else [] for t, n in zip(batch.tokens, lengths, strict=True)],
            resp,
            pad_id,
            torch.long,
        )
        mask = pad_rows(batch.loss_masks, resp, 0, torch.float32)
        # response token r of a row with prompt length p is predicted at position p - 1 + r
        n = torch.tensor(lengths)
        first = torch.tensor([len(t) for t in batch.tokens]) - n - 1
        cols = torch.arange(resp)
        index = torch.where(cols < n[:, None], first[:, None] + cols, 0)
        fields = {
            name: _pad_field(name, rows, resp, width) for name, rows in batch.token_fields.items()
        }
        return cls(input_ids, index, targets, mask, fields)

    def per_token(self, rows: list[list[float]]) -> torch.Tensor:
        """Response-aligned Python rows as a [B, R] float tensor beside `mask` (its device)."""
        return pad_rows(rows, self.mask.shape[1], 0.0, torch.float32).to(self.mask.device)

    def unpad(self, values: torch.Tensor, lengths: list[int]) -> list[list[float]]:
        return [values[i, :n].tolist() for i, n in enumerate(lengths)]

    def to(self, device: torch.device | str) -> PaddedBatch:
        """This micro-batch on `device` (fields included)."""
        return PaddedBatch(
            self.input_ids.to(device),
            self.targets_index.to(device),
            self.targets.to(device),
            self.mask.to(device),
            {k: v.to(device) for k, v in self.fields.items()},
        )


def _pad_field(name: str, rows: list[np.ndarray], resp: int, width: int) -> torch.Tensor:
    f = token_field(name)
    length = resp if f.align == "response" else width
    dtype = torch.from_numpy(f.empty()).dtype
    out = torch.full((len(rows), length, *f.shape), f.pad, dtype=dtype)
    for i, arr in enumerate(rows):
        if len(arr):
            out[i, : len(arr)] = torch.from_numpy(np.ascontiguousarray(arr))
    return out


def rollout_slices(rollout_ids: list[str], rollouts_per_slice: int) -> list[tuple[int, int]]:
    """[start, end) row ranges of consecutive rollouts, `rollouts_per_slice` whole rollouts each
    (a rollout's leaves are never split between two optimizer steps). A rollout's samples must
    be next to each other (rollout functions emit them so)."""
    bounds, count, start = [], 0, 0
    seen: set[str] = set()
    for i, rid in enumerate(rollout_ids):
        if i and rid != rollout_ids[i - 1]:
            if rid in seen:
                raise ValueError(f"rollout {rid!r}: its samples are not next to each other")
            count += 1
            if count == rollouts_per_slice:
                bounds.append((start, i))
                start, count = i, 0
        seen.add(rid)
    if rollout_ids:
        bounds.append((start, len(rollout_ids)))
    return bounds
