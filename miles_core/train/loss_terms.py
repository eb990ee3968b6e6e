"""Token-level pieces of the losses: log-probs, entropy, PPO-clip, k3 KL, masked aggregation.

All functions take per-token tensors of shape [B, T] and a 0/1 `mask`; aggregation is left to
`aggregate`, so the same masked sum can be normalised by the global token count (token_mean) or
per sequence (seq_mean_token_mean), or per rollout (rollout_mean_token_mean: siblings of one
agent session — sub-agents, compaction segments, tree leaves — share a rollout id and together
count as one sequence, so a harness that spawns many does not outweigh one that spawns few).
"""

from __future__ import annotations

import torch


def token_log_probs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """log p(targets) under softmax(logits / temperature); logits [B, T, V], targets [B, T]."""
    lp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def gathered_log_probs(
    logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """log p(ids) under softmax(logits / temperature) at every position; logits [B, T, V], ids
    [B, T, k] → [B, T, k] (LossNeeds.gather)."""
    lp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return lp.gather(-1, ids.long())


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    lp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return -(lp.exp() * lp).sum(-1)


def ppo_clip_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token (pg_loss, clipped indicator, approx kl old→new)."""
    log_ratio = log_probs - old_log_probs
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high)
    loss = torch.maximum(unclipped, clipped)
    clipfrac = (clipped > unclipped).float()
    return loss, clipfrac, -log_ratio


def k3_kl(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(π || π_ref): exp(ref − logp) − (ref − logp) − 1 ≥ 0."""
    d = (ref_log_probs - log_probs).clamp(-20.0, 20.0)
    return d.exp() - d - 1.0


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    denom: float,
    rollout_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Masked sum / denom. token_mean: denom = tokens in the global batch;
    seq_mean_token_mean: each row is first averaged over its own tokens, denom = sequences;
    rollout_mean_token_mean: each row's sum is divided by its rollout's token total
    (`rollout_tokens`, per row), denom = rollouts."""
    if mode == "token_mean":
        return (values * mask).sum() / denom
    if mode == "seq_mean_token_mean":
        per_seq = (values * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        return per_seq.sum() / denom
    if mode == "rollout_mean_token_mean":
        if rollout_tokens is None:
            raise ValueError("rollout_mean_token_mean needs each row's rollout token total")
        per_row = (values * mask).sum(-1) / rollout_tokens.clamp(min=1)
        return per_row.sum() / denom
    raise ValueError(f"unknown loss aggregation {mode!r}")
