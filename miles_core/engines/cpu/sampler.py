"""Token sampling from one step's logits: temperature, top-k, top-p, per row.

Each row is sampled by inverse CDF from one uniform number, which the caller draws: from the
engine's generator, or from a request's own seeded generator (so a seeded request's random
stream does not depend on the batch it runs in, and a batch of seeded requests still samples in
one op).
Log-probs are those of the temperature-scaled distribution before top-k/top-p truncation, which
is what the trainer recomputes (it divides its logits by the same temperature).
"""

from __future__ import annotations

import torch

from miles_core.true_on_policy import ops


def sample_next(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    uniforms: torch.Tensor,
    truncate: bool | None = None,
    invariant: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V], uniforms [B] in [0, 1) → (token ids [B], log-probs of those tokens [B]).
    `truncate`: whether any row has top-k or top-p (None: read it from the tensors);
    `invariant`: log-probs by the trainer's own function (`true_on_policy/ops.py`)."""
    scaled = logits.float() / temperature.unsqueeze(1)
    if invariant:
        logprobs = ops.tempered_log_softmax(logits, temperature)
    else:
        logprobs = torch.log_softmax(scaled, dim=-1)
    filtered = logprobs
    if truncate is None:
        truncate = bool((top_k > 0).any()) or bool((top_p < 1.0).any())
    if truncate:
        filtered = _truncate(logprobs, top_k, top_p)
    if bool(torch.isnan(scaled).any()):
        raise ValueError("the model produced NaN logits; cannot sample")
    # float64 CDF and uniforms: in fp32 the running sum near 1 has a step of 6e-8, and tokens
    # rarer than that (a large vocabulary's tail) could never be drawn
    cdf = filtered.exp().double().cumsum(-1)
    total = cdf[:, -1:]
    # the first token whose cdf exceeds u·total; u·total stays below total, so a token with
    # probability 0 (cut by top-k/top-p) is never chosen
    target = torch.minimum(uniforms.unsqueeze(1) * total, total.nextafter(torch.zeros_like(total)))
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return tokens, logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)


def _truncate(logprobs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_lp, order = torch.sort(logprobs, dim=-1, descending=True)
    vocab = logprobs.shape[-1]
    ranks = torch.arange(vocab, device=logprobs.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).unsqueeze(1)
    drop = ranks >= k
    # top-p: keep the smallest prefix whose mass reaches p (the first token is always kept)
    cum_before = torch.cumsum(sorted_lp.exp(), dim=-1) - sorted_lp.exp()
    drop |= cum_before >= top_p.unsqueeze(1)
    sorted_lp = sorted_lp.masked_fill(drop, float("-inf"))
    return torch.full_like(logprobs, float("-inf")).scatter(1, order, sorted_lp)
