"""Off-policy corrections: importance weights between the trainer's policy and the engine's.

Three policies meet in a step: π_θ (being trained), π_old (the trainer's recompute before the
step: the PPO denominator) and π_rollout (the engine that sampled, possibly older weights or
another precision). The ratio r_t = π_old(y_t) / π_rollout(y_t) = exp(old_t − rollout_t) measures
that mismatch per token; a correction turns it into a per-token weight w_t (detached) that
multiplies the policy-gradient loss:

- `tis` (truncated IS): w = clamp(r, low, high);
- `icepop`: w = r inside [low, high], 0 outside (the token is masked out);
- `mis` (masked/multiple IS): the ratio at `level` token (r_t), sequence (∏ r_t) or geometric
  (exp(mean log r_t)); `mis_mode` truncate clamps it, mask zeroes the sequence when it leaves
  [low, high] (rejection); `veto_threshold` rejects any sequence holding a token with r_t below it
  (a catastrophic token).

Weights scale the numerator only: the loss's denominator (the global or per-sample token count)
keeps every token, so rejecting tokens does not inflate the gradient of those kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MODES = ("none", "tis", "icepop", "mis")
LEVELS = ("token", "sequence", "geometric")


@dataclass
class Correction:
    weights: torch.Tensor  # [B, T], 0 on masked tokens, detached
    stats: dict[str, float]  # token sums (prefixed "_") and sequence counts, for `_reduce`


def correction_weights(
    old: torch.Tensor,
    rollout: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    low: float = 0.0,
    high: float = 2.0,
    level: str = "token",
    mis_mode: str = "truncate",
    veto_threshold: float | None = None,
) -> Correction:
    """old, rollout: per-token log-probs [B, T]; mask: 0/1 loss mask [B, T]."""
    if mode not in MODES:
        raise ValueError(f"unknown off-policy correction {mode!r}; choose one of {MODES}")
    # -inf − -inf is NaN: a token both policies rule out carries no evidence, so log r = 0
    log_r = (torch.nan_to_num(old - rollout, nan=0.0, posinf=20.0, neginf=-20.0) * mask).detach()
    ratio = log_r.clamp(-20.0, 20.0).exp()
    r = ratio  # the ratio at the correction's level, before clipping or masking
    if mode == "none":
        w = torch.ones_like(ratio)
        r = w
    elif mode == "tis":
        w = ratio.clamp(low, high)
    elif mode == "icepop":
        w = torch.where((ratio >= low) & (ratio <= high), ratio, torch.zeros_like(ratio))
    else:
        r = _level_ratio(log_r, ratio, mask, level)
        if mis_mode == "truncate":
            w = r.clamp(low, high)
        elif mis_mode == "mask":
            w = torch.where((r >= low) & (r <= high), r, torch.zeros_like(r))
        else:
            raise ValueError(f"unknown MIS mode {mis_mode!r}; choose truncate or mask")
        if veto_threshold is not None:
            vetoed = ((ratio < veto_threshold) & (mask > 0)).any(-1, keepdim=True)
            w = torch.where(vetoed, torch.zeros_like(w), w)
    w = w * mask
    changed = ((w != r) & (mask > 0)).float()
    rejected_rows = ((w * mask).sum(-1) == 0) & (mask.sum(-1) > 0)
    stats = {
        "_tis": float(w.sum()),
        "_tis_clipfrac": float(changed.sum()),
        "_tis_abs": float(((ratio - 1.0).abs() * mask).sum()),
        "mis_rejected_seqs": float(rejected_rows.sum()),
    }
    return Correction(weights=w, stats=stats)


def _level_ratio(log_r, ratio, mask, level) -> torch.Tensor:
    if level not in LEVELS:
        raise ValueError(f"unknown MIS level {level!r}; choose one of {LEVELS}")
    if level == "token":
        return ratio
    total = log_r.sum(-1, keepdim=True)
    if level == "geometric":
        total = total / mask.sum(-1, keepdim=True).clamp(min=1)
    return total.clamp(-20.0, 20.0).exp().expand_as(ratio)
