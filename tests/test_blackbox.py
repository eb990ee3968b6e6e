"""A black-box harness (examples/blackbox_harness/agent.py: the official openai client, a
sub-agent, context compaction) trained through the session server: its trajectory tree is
recorded leaf by leaf under one rollout id, and the leaves train with per-rollout
normalisation."""

import asyncio
import math
from pathlib import Path

import pytest

from miles_core.agents.blackbox import python_agent
from miles_core.agents.layers import GenerateInput
from miles_core.agents.session_generate import session_generate
from miles_core.config import RunConfig
from miles_core.train.backends.fsdp import FSDPBackend
from miles_core.train.batch import TrainBatch
from miles_core.train.losses.policy import PolicyOptions
from miles_core.types import Status

HARNESS = Path(__file__).parents[1] / "examples" / "blackbox_harness" / "agent.py"


@pytest.fixture(scope="module")
def setup(session_stack):
    engine, sessions = session_stack
    return sessions.url, engine.model_dir


def _episode(url: str, agent, rollout_id: str, timeout_s: float = 120.0):
    inp = GenerateInput(
        prompt=[{"role": "user", "content": "write a file"}],
        metadata={},
        request_kwargs={},
        rollout_id=rollout_id,
        session_url=url,
    )
    return asyncio.run(session_generate(inp, agent, timeout_s))


def test_a_black_box_harness_with_a_sub_agent_and_compaction_records_a_tree(setup):
    url, model_dir = setup
    out = _episode(url, python_agent(str(HARNESS)), "bb-0")
    assert out.error is None and out.metrics == {"turns": 4.0}
    assert out.reward in (0.0, 1.0)
    # leaves: the main agent before compaction (2 turns), the sub-agent, the compacted main
    samples = out.samples
    assert len(samples) == 3 and {s.rollout_id for s in samples} == {"bb-0"}
    assert sorted(s.metadata["turns"] for s in samples) == [1, 1, 2]
    for s in samples:
        s.validate()
        assert s.reward == out.reward and s.status in (Status.COMPLETED, Status.TRUNCATED)
    # the three leaves train as one rollout
    cfg = RunConfig().train.model_copy(
        update={
            "loss_options": PolicyOptions(loss_agg="rollout_mean_token_mean"),
            "micro_batch_size": 3,
        }
    )
    trainer = FSDPBackend(str(model_dir), optim=cfg.model_dump(), loss=cfg.model_dump())
    batch = TrainBatch.from_samples(samples, [1.0] * 3, temperature=1.0)
    batch.old_log_probs = trainer.compute_log_probs(batch)
    for old, s in zip(batch.old_log_probs, samples, strict=True):  # trainer sees engine tokens
        gen = [(a, b) for a, b, m in zip(old, s.rollout_log_probs, s.loss_mask, strict=True) if m]
        assert max(abs(a - b) for a, b in gen) < 1e-4
    metrics = trainer.train_step(batch)
    assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    trainer.close()


def test_a_harness_that_crashes_or_hangs_fails_its_episode_and_is_stopped(setup, tmp_path):
    url, _ = setup
    crash = tmp_path / "crash.py"
    crash.write_text("import sys\nprint('boom', file=sys.stderr)\nsys.exit(3)\n")
    out = _episode(url, python_agent(str(crash)), "bb-1")
    assert "exited with code 3: boom" in out.error and out.samples == []
    hang = tmp_path / "hang.py"
    hang.write_text("import time\ntime.sleep(600)\n")
    out = _episode(url, python_agent(str(hang)), "bb-2", timeout_s=1.0)
    assert "timed out" in out.error
