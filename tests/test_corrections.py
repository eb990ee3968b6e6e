"""Off-policy corrections (TIS, ICEPOP, MIS): weights, rejection, and the denominator rule."""

import copy
import math

import pytest
import torch
from test_trainer import _rollout, _trainer

from miles_core.engines.cpu.embedded import EmbeddedEngine
from miles_core.train.corrections import correction_weights
from miles_core.train.losses.policy import OffPolicyOptions


def _w(ratios, mask=None, **kw):
    """Rows of per-token ratios π_old/π_rollout → weights (old = log r, rollout = 0)."""
    old = torch.log(torch.tensor(ratios, dtype=torch.float32))
    mask = torch.ones_like(old) if mask is None else torch.tensor(mask, dtype=torch.float32)
    return correction_weights(old, torch.zeros_like(old), mask, **kw)


def test_tis_truncates_and_counts_clipped_tokens():
    c = _w([[0.5, 1.0, 3.0]], mode="tis", low=0.0, high=2.0)
    assert torch.allclose(c.weights, torch.tensor([[0.5, 1.0, 2.0]]))
    assert c.stats["_tis_clipfrac"] == 1.0 and c.stats["_tis"] == pytest.approx(3.5)


def test_icepop_masks_tokens_outside_the_band_and_passes_the_rest_through():
    c = _w([[0.4, 1.25, 2.5]], mode="icepop", low=0.5, high=2.0)
    assert torch.allclose(c.weights, torch.tensor([[0.0, 1.25, 0.0]]))
    assert c.stats["_tis_clipfrac"] == 2.0


def test_mis_sequence_and_geometric_levels_reject_or_truncate_whole_sequences():
    rows = [[2.0, 2.0, 1.0], [1.1, 0.9, 1.0]]  # products 4.0 and 0.99
    c = _w(rows, mode="mis", level="sequence", mis_mode="mask", low=0.5, high=2.0)
    assert c.weights[0].eq(0).all() and torch.allclose(c.weights[1], torch.full((3,), 0.99))
    assert c.stats["mis_rejected_seqs"] == 1.0
    g = _w(rows, mode="mis", level="geometric", mis_mode="truncate", low=0.0, high=1.5)
    assert torch.allclose(g.weights[0], torch.full((3,), 1.5))  # 4^(1/3) ≈ 1.587 → 1.5
    assert torch.allclose(g.weights[1], torch.full((3,), 0.99 ** (1 / 3)))


def test_mis_veto_rejects_a_sequence_with_one_catastrophic_token_and_padding_is_ignored():
    c = _w(
        [[1.0, 1e-6, 1.0], [1.0, 1.0, 1e-6]],
        [[1, 1, 1], [1, 1, 0]],  # row 2's tiny ratio sits on padding
        mode="mis",
        level="token",
        veto_threshold=1e-4,
    )
    assert c.weights[0].eq(0).all()
    assert torch.equal(c.weights[1], torch.tensor([1.0, 1.0, 0.0]))
    assert c.stats["mis_rejected_seqs"] == 1.0


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="unknown off-policy correction"):
        _w([[1.0]], mode="is", low=0.0, high=2.0)
    with pytest.raises(ValueError, match="unknown MIS level"):
        _w([[1.0]], mode="mis", low=0.0, high=2.0, level="batch")


def test_masked_tokens_leave_the_denominator_unchanged(tiny_dir, tiny):
    """ICEPOP rejects one token: pg_loss = −Σ_kept A / (all tokens), not / (kept tokens)."""
    model, tok = tiny
    batch = _rollout(EmbeddedEngine(copy.deepcopy(model), tok, seed=0), tok, n=8)
    trainer = _trainer(tiny_dir, off_policy=OffPolicyOptions(mode="icepop", low=0.5, high=2.0))
    batch.old_log_probs = trainer.compute_log_probs(batch)
    batch.rollout_log_probs = [list(r) for r in batch.old_log_probs]
    batch.rollout_log_probs[0][0] -= 5.0  # ratio e^5: outside the band, masked
    m = trainer.train_step(batch)
    tokens = sum(batch.response_lengths)
    kept = sum(a * n for a, n in zip(batch.advantages, batch.response_lengths, strict=True))
    kept -= batch.advantages[0]
    assert m["pg_loss"] == pytest.approx(-kept / tokens, abs=1e-6)  # on-policy step: ratio 1
    assert m["tis_clipfrac"] == pytest.approx(1 / tokens)
    assert m["tis"] == pytest.approx((tokens - 1) / tokens, abs=1e-6)
    assert not math.isnan(m["tis_abs"])


def test_a_correction_without_engine_logprobs_is_a_clear_error(tiny_dir, tiny):
    model, tok = tiny
    batch = _rollout(EmbeddedEngine(copy.deepcopy(model), tok, seed=0), tok, n=8)
    trainer = _trainer(tiny_dir, off_policy=OffPolicyOptions(mode="tis"))
    batch.old_log_probs = trainer.compute_log_probs(batch)
    batch.rollout_log_probs = None
    with pytest.raises(ValueError, match="needs the engine's log-probs"):
        trainer.train_step(batch)


def test_tokens_both_policies_rule_out_do_not_poison_the_batch():
    old = torch.tensor([[float("-inf"), -1.0, -0.5]])
    c = correction_weights(old, old.clone(), torch.ones_like(old), mode="mis", level="sequence")
    assert torch.isfinite(c.weights).all() and torch.allclose(c.weights, torch.ones(1, 3))
