"""Inverse-CDF sampling: the right distribution, and truncated tokens are never drawn."""

import torch

from miles_core.engines.cpu.sampler import sample_next


def _draw(logits, n, top_k=-1, top_p=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = logits.expand(n, -1)
    tokens, lps = sample_next(
        rows,
        torch.ones(n),
        torch.full((n,), top_k, dtype=torch.long),
        torch.full((n,), top_p),
        torch.rand(n, generator=g),
    )
    return tokens, lps


def test_frequencies_follow_the_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]])
    tokens, lps = _draw(logits, 200_000)
    freq = torch.bincount(tokens, minlength=5).float() / len(tokens)
    probs = torch.softmax(logits[0], -1)
    assert torch.allclose(freq, probs, atol=4e-3)  # ≈ 4 standard errors at n = 200k
    assert torch.allclose(lps, torch.log(probs)[tokens])


def test_tokens_cut_by_top_k_and_top_p_are_never_drawn_even_at_the_edges():
    logits = torch.tensor([[0.0, 3.0, 2.9, -5.0, 2.8, 0.1]])
    top2, _ = _draw(logits, 50_000, top_k=2)
    assert set(top2.tolist()) == {1, 2}
    nucleus, _ = _draw(logits, 50_000, top_p=0.5)
    assert set(nucleus.tolist()) <= {1, 2} and len(set(nucleus.tolist())) == 2
    n = 4  # u = 0 and u just below 1 pick the first and the last kept token
    edges = torch.tensor([0.0, 1.0 - 2**-53, 0.0, 1.0 - 2**-53], dtype=torch.float64)
    tokens, _ = sample_next(
        logits.expand(n, -1),
        torch.ones(n),
        torch.tensor([2, 2, -1, -1]),
        torch.ones(n),
        edges,
    )
    assert tokens.tolist() == [1, 2, 0, 5]


def test_a_tail_token_rarer_than_fp32_resolution_can_be_drawn():
    logp = torch.log(torch.tensor([[1 - 2e-9, 1e-9, 1e-9]], dtype=torch.float64)).float()
    u = torch.tensor([1 - 1.5e-9], dtype=torch.float64)  # lands in token 1's sliver of the CDF
    token, lp = sample_next(logp, torch.ones(1), torch.tensor([-1]), torch.ones(1), u)
    assert token.item() == 1 and lp.item() < -20
