"""Agentic RL end to end in the runtime: the session server starts beside the engine server,
episodes run the terminal agent in sandboxes, rewards come from the checker, the batch trains
with per-rollout normalisation, and everything the run started stops."""

import tempfile
from pathlib import Path

import pytest

from miles_core.config import load_config
from miles_core.envs.terminal import KINDS
from miles_core.run.runtime import RLRuntime, prepare_model_dir

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
            "rollout.engine_options.threads=1",
            "rollout.prompts_per_step=2",
            "rollout.n_samples_per_prompt=2",
            "weight_sync.transport=shared_memory",
            "weight_sync.check_equal=true",
            "agent.function=miles_core.envs.sandbox_agent:run_agent",
            "agent.max_turns=2",
            "agent.max_tokens=24",
            "train.global_batch_size=4",
            "train.micro_batch_size=4",
            "train.loss_options.loss_agg=rollout_mean_token_mean",
            "train.threads=1",
            f"checkpoint.root={tmp_path}/ckpt",
            "agent.eval_episodes=7",  # one of each kind, the held-out one last
            "train.num_steps=2",
            *extra,
        ],
    )


@pytest.mark.slow
def test_two_agentic_steps_train_on_session_samples_and_stop_everything(tmp_path):
    cfg = _config(
        tmp_path, "agent.reward_function=test_agentic_run:tenfold", "agent.eval_samples=2"
    )
    rt = RLRuntime(cfg, prepare_model_dir(cfg, Path(tempfile.mkdtemp())), None)
    procs = [rt.engine_process, rt.session_process]
    try:
        assert rt.eval_due(0) and not rt.eval_due(1) and rt.eval_due(2)  # first and last
        rt.submit_evaluation(0)
        [(version, before)] = rt.finished_evaluations()
        assert version == 0 and before["eval/lag_steps"] == 0.0 and before["eval/errors"] == 0.0
        assert before["eval/policy_version"] == 0.0 and before["eval/failed_episodes"] == 0.0
        assert before["eval/agent/turns_episodes"] == 14.0  # 2 samples of each of 7 tasks
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
            m = {
                k: result.metrics[f"agent/{k}_mean"] for k in ("episode_s", "model_s", "sandbox_s")
            }
            assert 0 < m["model_s"] + m["sandbox_s"] <= m["episode_s"], m  # where the time went
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
    # the hook scored every episode: 2 × 7 evaluation episodes twice, 4 training ones per step
    assert sorted(HOOK_CALLS) == sorted(
        [f"eval-{i}" for i in range(14)] * 2
        + [f"s{t}-g{g}-{k}" for t in (0, 1) for g in (0, 1) for k in (0, 1)]
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "pause_mode, steps, extra",
    [("retract", 30, ()), ("in_place", 10, ("train.lora.rank=4",))],
)
def test_fully_async_agentic_steps_keep_the_staleness_bound_in_each_pause_mode(
    tmp_path, pause_mode, steps, extra
):
    """fully_async steps (30 in the default pause mode) of one group of two episodes, pushes in
    `pause_mode` while episodes run: every step trains exactly its own episodes (none lost,
    none twice, across every push), and no sample's oldest model call is more than
    max_staleness versions behind the step. In place: a LoRA run (every turn names the
    adapter, which the engine requires; pushes carry it alone)."""
    staleness = 2
    cfg = _config(
        tmp_path,
        "rollout.mode=fully_async",
        f"rollout.mode_options.max_staleness={staleness}",
        f"rollout.pause_mode={pause_mode}",
        "rollout.prompts_per_step=1",
        "train.global_batch_size=2",
        "train.micro_batch_size=2",
        "agent.max_tokens=8",
        "agent.concurrency=2",
        "agent.eval_episodes=0",
        "weight_sync.check_equal=false",
        f"train.num_steps={steps}",
        *extra,
    )
    rt = RLRuntime(cfg, prepare_model_dir(cfg, Path(tempfile.mkdtemp())), None)
    trained: list[str] = []
    try:
        for step in range(steps):
            result = rt.rollout(step)
            ids = sorted({s.rollout_id for s in result.samples})
            assert ids == [f"s{step}-g0-0", f"s{step}-g0-1"]
            assert result.metrics["rollout/failed_episodes"] == 0.0
            assert result.metrics["agent/turns_episodes"] == 2.0  # every episode's outcome
            assert 0.0 <= result.metrics["rollout/active_episodes_mean"] <= 2.0  # the limit
            assert result.metrics["rollout/staleness/max"] <= staleness
            assert all(min(s.weight_versions) >= step - staleness for s in result.samples)
            trained += ids
            rt.train(result)
            rt.update_weights()
    finally:
        rt.close()
    assert len(trained) == len(set(trained)) == 2 * steps


def test_a_tito_family_that_does_not_match_the_model_is_refused(tiny):
    from miles_core.tito.check import check_family_matches

    _, tok = tiny
    check_family_matches("tiny", tok)  # the model's own family
    with pytest.raises(ValueError, match="agent.family 'qwen3' does not tokenize like the model"):
        check_family_matches("qwen3", tok)


def test_agentic_rollout_refuses_configs_it_cannot_run(tmp_path):
    with pytest.raises(ValueError, match="needs an engine server .* set rollout.engine: server"):
        _config(
            tmp_path,
            "rollout.engine=serving",
            "rollout.engine_options={}",
            "weight_sync.transport=colocated",
        )
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


@pytest.mark.slow
def test_two_engines_behind_the_router_lose_one_mid_episode_and_lose_no_episode(tmp_path):
    """rollout.engine_options.num_engines=2: sessions reach the engines through sglang-router. Engine 0 is
    killed (SIGKILL) while it serves episodes: every episode of the step comes back exactly
    once, either complete or FAILED with its reason and a zero loss mask (trains nothing); the
    supervisor replaces engine 0, gives it the current weights, and the router takes it back;
    the next push reaches both engines (checked bitwise), and the next step runs on both, with
    per-engine gauges."""
    from concurrent.futures import ThreadPoolExecutor

    from miles_core.types import Status

    # each episode routed by itself (not by group): the step's episodes spread over both
    cfg = _config(
        tmp_path,
        "rollout.engine_options.num_engines=2",
        "agent.eval_episodes=2",
        "agent.routing=session",
    )
    rt = RLRuntime(cfg, prepare_model_dir(cfg, Path(tempfile.mkdtemp())), None)
    try:
        rt.submit_evaluation(0)  # its episodes go through the router too (u64 seeds only)
        [(_, before)] = rt.finished_evaluations(wait=True)
        assert before["eval/failed_episodes"] == 0.0
        victim, victim_client = rt.fleet.servers[0]
        with ThreadPoolExecutor(1) as pool:
            rollout = pool.submit(rt.rollout, 0)
            while victim_client.server_info()["running"] == 0:  # a model call on engine 0
                assert not rollout.done(), "the step ended before engine 0 served a call"
            victim.proc.kill()
            result = rollout.result(timeout=300)
        episodes = [f"s0-g{g}-{k}" for g in (0, 1) for k in (0, 1)]
        assert sorted({s.rollout_id for s in result.samples}) == episodes  # none lost
        failed = {s.rollout_id for s in result.samples if s.status == Status.FAILED}
        for s in result.samples:
            if s.rollout_id in failed:  # the whole episode is out, with its reason
                assert s.status == Status.FAILED and not any(s.loss_mask) and s.reward == 0.0
                assert s.metadata["error"]
        assert result.metrics["rollout/failed_episodes"] == float(len(failed))
        rt.train(result)
        rt.update_weights()  # waits for the replacement; check_equal on both engines
        assert rt.fleet.with_health(result).metrics["rollout/engine_restarts_total"] == 1.0
        assert victim.url in rt.fleet.router.healthy_urls()  # back in rotation
        result = rt.rollout(1)
        assert result.metrics["rollout/failed_episodes"] == 0.0
        assert {"engine/0/active_requests", "engine/1/active_requests"} <= set(result.metrics)
    finally:
        rt.close()
