"""Agentic RL end to end in the runtime: the session server starts beside the engine server,
episodes run the terminal agent in sandboxes, rewards come from the checker, the batch trains
with per-rollout normalisation, and everything the run started stops."""

import tempfile
from pathlib import Path

import pytest

from miles_core.config import load_config
from miles_core.envs.terminal import KINDS
from miles_core.runtime import RLRuntime, prepare_model_dir

HOOK_CALLS: list[str] = []


def tenfold(episode) -> float:  # a per-episode reward hook on top of the checker's score
    HOOK_CALLS.append(episode.samples[0].rollout_id)
    return 10.0 * episode.env_reward


def _config(tmp_path, *extra):
    return load_config(
        None,
        [
            "model.preset=tiny",
            "data.task=terminal",
            "data.num_prompts=16",
            "rollout.engine=server",
            "rollout.engine_threads=1",
            "rollout.prompts_per_step=2",
            "rollout.n_samples_per_prompt=2",
            "weight_sync.transport=shared_memory",
            "weight_sync.check_equal=true",
            "agent.function=miles_core.envs.sandbox_agent:run_agent",
            "agent.max_turns=2",
            "agent.max_tokens=24",
            "train.global_batch_size=4",
            "train.micro_batch_size=4",
            "train.loss_agg=rollout_mean_token_mean",
            "train.threads=1",
            f"checkpoint.root={tmp_path}/ckpt",
            "agent.eval_episodes=7",  # one of each kind, the held-out one last
            "train.num_steps=2",
            *extra,
        ],
    )


@pytest.mark.slow
def test_two_agentic_steps_train_on_session_samples_and_stop_everything(tmp_path):
    cfg = _config(tmp_path, "agent.reward_function=test_agentic_run:tenfold")
    rt = RLRuntime(cfg, prepare_model_dir(cfg, Path(tempfile.mkdtemp())), None)
    procs = [rt.engine_process, rt.session_process]
    try:
        assert rt.eval_due(0) and not rt.eval_due(1) and rt.eval_due(2)  # first and last
        rt.submit_evaluation(0)
        [(version, before)] = rt.finished_evaluations()
        assert version == 0 and before["eval/lag_steps"] == 0.0 and before["eval/errors"] == 0.0
        assert before["eval/policy_version"] == 0.0 and before["eval/failed_episodes"] == 0.0
        groups = {k.removeprefix("eval/success_rate/") for k in before if "rate/" in k}
        levels = {g for g in groups if g.startswith("level_")}  # per difficulty level
        assert groups - levels <= set(KINDS) and levels and "create-fix" in groups  # held out
        for step in range(2):
            result = rt.rollout(step)
            assert len(result.groups) == 2
            for s in result.samples:
                s.validate()
                assert s.rollout_id.startswith(f"s{step}-") and s.reward in (0.0, 10.0)
            assert result.metrics["rollout/reward_hook_failures"] == 0.0
            assert 0.0 <= result.metrics["rollout/success_rate"] <= 1.0
            assert result.metrics["agent/turns_mean"] >= 1.0
            assert result.metrics["rollout/session/tito_token_edits"] == 0.0
            assert result.metrics["rollout/session/branches"] == 0.0  # the agent appends only
            metrics = rt.train(result)
            assert metrics["train/grad_norm"] >= 0.0
            rt.update_weights()  # check_equal: the engine holds the trained weights
        rt.submit_evaluation(2)  # eval sessions are not counted in a step's session metrics
        [(version, after)] = rt.finished_evaluations()
        assert version == 2 and after["eval/policy_version"] == 2.0
        assert 0.0 <= after["eval/success_rate"] <= 1.0
    finally:
        rt.close()
    for p in procs:
        assert p.proc.poll() is not None  # both servers stopped
    # the hook scored every episode: 6 evaluation episodes twice, 4 training episodes per step
    assert sorted(HOOK_CALLS) == sorted(
        [f"eval-{i}" for i in range(7)] * 2
        + [f"s{t}-g{g}-{k}" for t in (0, 1) for g in (0, 1) for k in (0, 1)]
    )


@pytest.mark.slow
def test_fully_async_agentic_steps_keep_the_staleness_bound_and_every_episode_once(tmp_path):
    """fully_async: the producer admits groups of episodes ahead of the trainer under paced
    admission; every step gets exactly its own episodes (none lost, none twice), each sample
    at most max_staleness versions old (whether an episode starts before or after a push is
    timing, so neither is asserted). The checkpoint after step 1 holds the producer's buffer
    (what it had admitted of step 2 by then, done or running): a runtime resumed from it trains
    steps 2 and 3 on exactly their own episodes, with every episode's outcome (restored groups:
    from the metadata saved with them)."""
    steps = 4
    cfg = _config(
        tmp_path,
        "rollout.mode=fully_async",
        "rollout.max_staleness=1",
        "agent.concurrency=2",
        "agent.eval_episodes=0",
        f"train.num_steps={steps}",
    )

    def run(rt, step):
        result = rt.rollout(step)
        ids = sorted(s.rollout_id for s in result.samples)  # no leaf twice
        assert ids == [f"s{step}-g{g}-{k}" for g in (0, 1) for k in (0, 1)]
        assert result.metrics["rollout/staleness/max"] <= 1.0
        assert all(step - 1 <= min(s.weight_versions) <= step for s in result.samples)
        assert result.metrics["rollout/failed_episodes"] == 0.0
        assert result.metrics["agent/turns_episodes"] == 4.0  # every episode's outcome
        assert 0.0 < result.metrics["rollout/active_episodes_mean"] <= 2.0
        assert result.metrics["rollout/session/tito_token_edits"] == 0.0
        rt.train(result)
        rt.update_weights()  # check_equal: the engine holds the trained weights

    rt = RLRuntime(cfg, prepare_model_dir(cfg, Path(tempfile.mkdtemp())), None)
    try:
        for step in (0, 1):
            run(rt, step)
        rt.save(1)
    finally:
        rt.close()
    rt = RLRuntime(cfg, prepare_model_dir(cfg, Path(tempfile.mkdtemp())), None)
    try:
        rt.resume(1)
        for step in (2, 3):
            run(rt, step)
    finally:
        rt.close()


def test_a_tito_family_that_does_not_match_the_model_is_refused(tiny):
    from miles_core.tito.check import check_family_matches

    _, tok = tiny
    check_family_matches("tiny", tok)  # the model's own family
    with pytest.raises(ValueError, match="agent.family 'qwen3' does not tokenize like the model"):
        check_family_matches("qwen3", tok)


def test_agentic_rollout_refuses_configs_it_cannot_run(tmp_path):
    with pytest.raises(ValueError, match="needs an engine server .* set rollout.engine: server"):
        _config(tmp_path, "rollout.engine=serving", "weight_sync.transport=colocated")
    with pytest.raises(ValueError, match="unknown TITO family 'gpt2'"):
        _config(tmp_path, "agent.family=gpt2")


@pytest.mark.slow
def test_a_black_box_harness_trains_from_its_config(tmp_path):
    """examples/blackbox_harness_cpu.yaml: every episode is the harness program (sub-agent and
    compaction), recorded as a three-leaf tree; the leaves of an episode train as one rollout."""
    cfg = load_config(
        Path(__file__).parents[1] / "examples" / "blackbox_harness_cpu.yaml",
        [
            "rollout.prompts_per_step=2",
            "rollout.n_samples_per_prompt=2",
            "train.global_batch_size=4",
            "train.micro_batch_size=4",
            "train.threads=1",
            f"checkpoint.root={tmp_path}/ckpt",
        ],
    )
    rt = RLRuntime(cfg, prepare_model_dir(cfg, Path(tempfile.mkdtemp())), None)
    try:
        result = rt.rollout(0)
        assert result.metrics["rollout/failed_episodes"] == 0.0
        assert result.metrics["rollout/samples_per_episode"] == 3.0
        assert result.metrics["rollout/session/branches"] == 8.0  # 2 per episode
        assert result.metrics["rollout/session/tito_token_edits"] == 0.0
        for group in result.groups:
            assert len({s.rollout_id for s in group.samples}) == 2 and len(group.samples) == 6
        metrics = rt.train(result)  # one optimizer step: 4 rollouts = 12 leaves
        assert metrics["train/grad_norm"] >= 0.0
    finally:
        rt.close()
