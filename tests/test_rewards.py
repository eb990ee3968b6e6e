"""Reward hooks of agentic rollout: per episode and per group on top of the environment's reward,
in that order; a hook that raises, hangs, or returns a bad value fails only the episodes it
scored (with the reason), never the step; plug-in paths are checked before anything starts."""

import asyncio
import threading

import pytest
from test_agents import _Server  # imported (and rewritten) at collection

from miles_core.agents.layers import GenerateOutput
from miles_core.agents.rewards import Episode, RewardHooks
from miles_core.config import load_config
from miles_core.run.preflight import preflight
from miles_core.types import Sample


def _sample(rollout_id: str) -> Sample:
    return Sample(
        group_index=0,
        index=0,
        rollout_id=rollout_id,
        prompt="",
        tokens=[1, 2, 3],
        response_length=2,
        loss_mask=[1, 1],
        rollout_log_probs=[-0.5, -0.5],
        weight_versions=[0, 0],
    )


def _outputs(env_rewards):
    return [
        GenerateOutput([_sample(f"r{i}")], reward, {"turns": 1.0})
        for i, reward in enumerate(env_rewards)
    ]


def _apply(hooks, outputs, n):
    tasks = [{"kind": "k", "i": i} for i in range(len(outputs))]
    return asyncio.run(hooks.apply(outputs, tasks, n))


def length_bonus(episode: Episode) -> float:  # plain function: env reward + 0.5 per leaf
    return (episode.env_reward or 0.0) + 0.5 * len(episode.samples)


async def rank_in_group(episodes: list[Episode]) -> list[float]:  # async, sees hook rewards
    def key(i):  # failed episodes (error set, reward maybe None) rank last
        e = episodes[i]
        return float("-inf") if e.error or e.reward is None else e.reward

    order = sorted(range(len(episodes)), key=key)
    return [float(order.index(i)) for i in range(len(episodes))]


def test_hooks_apply_in_order_environment_then_episode_then_group():
    outputs = _outputs([1.0, 0.0, None, 2.0])  # one episode without an env reward
    failed = _apply(RewardHooks(length_bonus, rank_in_group, timeout_s=5), outputs, n=2)
    assert failed == 0
    # per episode: 1.5, 0.5, 0.5, 2.5; per group ranks: [1, 0], [0, 1]
    assert [o.reward for o in outputs] == [1.0, 0.0, 0.0, 1.0]
    assert all(o.error is None for o in outputs)


def test_a_hook_sees_the_episode_samples_task_and_metrics():
    seen = []

    def record(episode: Episode) -> float:
        seen.append((episode, episode.reward))
        return 1.0

    outputs = _outputs([0.25])
    _apply(RewardHooks(record, None, timeout_s=5), outputs, n=1)
    ((e, reward_when_called),) = seen
    assert e.env_reward == 0.25 and reward_when_called == 0.25
    assert e.task == {"kind": "k", "i": 0}
    assert e.samples[0].rollout_id == "r0" and e.metrics == {"turns": 1.0}
    assert outputs[0].reward == 1.0


def _hangs_forever(episode):
    threading.Event().wait()  # a plain hook that never returns: abandoned at the timeout


async def _hangs_async(episode):
    await asyncio.Event().wait()


def _raises(episode):
    return 1 / 0


@pytest.mark.parametrize(
    "hook, reason",
    [
        (_raises, "agent.reward_function raised ZeroDivisionError"),
        (lambda e: float("nan"), "non-finite reward (nan)"),
        (lambda e: float("inf"), "non-finite reward (inf)"),
        (lambda e: "1.0", "returned str, not a number"),
        (lambda e: True, "returned bool, not a number"),
        (_hangs_async, "timed out after 0.2 s"),
        (_hangs_forever, "timed out after 0.2 s"),
    ],
)
def test_a_failing_episode_hook_fails_that_episode_only(hook, reason):
    if asyncio.iscoroutinefunction(hook):

        async def second_fails(episode):
            return await hook(episode) if episode.task["i"] == 1 else 0.75
    else:

        def second_fails(episode):
            return hook(episode) if episode.task["i"] == 1 else 0.75

    outputs = _outputs([1.0, 1.0, 1.0])
    assert _apply(RewardHooks(second_fails, None, timeout_s=0.2), outputs, n=3) == 1
    assert outputs[0].reward == outputs[2].reward == 0.75
    assert outputs[1].reward is None and reason in outputs[1].error
    assert outputs[0].error is None and outputs[2].error is None


@pytest.mark.parametrize(
    "group_hook, reason",
    [
        (lambda es: [1.0], "must return a list of 2 rewards"),
        (lambda es: {"a": 1}, "must return a list of 2 rewards"),
        (lambda es: [1.0, float("-inf")], "non-finite reward (-inf)"),
        (lambda es: es[5], "raised IndexError"),
    ],
)
def test_a_failing_group_hook_fails_its_group_only(group_hook, reason):
    def only_first_group(episodes):
        return group_hook(episodes) if episodes[0].task["i"] == 0 else [0.5, 0.25]

    outputs = _outputs([1.0, 0.0, 1.0, 0.0])
    assert _apply(RewardHooks(None, only_first_group, timeout_s=5), outputs, n=2) == 2
    assert all(reason in o.error for o in outputs[:2])
    assert [o.reward for o in outputs[2:]] == [0.5, 0.25]
    assert all(o.error is None for o in outputs[2:])


def test_a_group_hook_sees_failed_episodes_marked_and_they_stay_failed():
    seen = []

    def record(episodes):
        seen.extend((e.error, e.reward) for e in episodes)
        return [1.0] * len(episodes)

    outputs = _outputs([1.0, None, 0.0])
    outputs[1].error = "agent timed out after 120 s"
    assert _apply(RewardHooks(None, record, timeout_s=5), outputs, n=3) == 0
    assert seen == [(None, 1.0), ("agent timed out after 120 s", None), (None, 0.0)]
    assert outputs[1].error == "agent timed out after 120 s"  # still failed
    assert [o.env_reward for o in outputs] == [1.0, None, 0.0]  # the environment's grade kept


class _AsyncCall:  # a callable object whose call returns a coroutine
    async def __call__(self, episode):
        return 2.0


def _exits(episode):
    raise SystemExit(3)


async def _own_timeout(episode):
    raise TimeoutError("judge did not answer")


def test_awaitables_are_awaited_a_hooks_own_timeout_is_a_failure_and_an_exit_stops():
    outputs = _outputs([1.0])
    assert _apply(RewardHooks(_AsyncCall(), None, timeout_s=5), outputs, n=1) == 0
    assert outputs[0].reward == 2.0
    outputs = _outputs([1.0])
    assert _apply(RewardHooks(_own_timeout, None, timeout_s=5), outputs, n=1) == 1
    assert "raised TimeoutError('judge did not answer')" in outputs[0].error  # not "timed out"
    with pytest.raises(SystemExit):  # a hook that stops the process is obeyed
        _apply(RewardHooks(_exits, None, timeout_s=5), _outputs([1.0]), n=1)


def test_an_episode_that_already_failed_keeps_its_own_reason():
    outputs = _outputs([1.0, 1.0])
    outputs[0].error = "agent timed out after 120 s"
    _apply(RewardHooks(length_bonus, None, timeout_s=5), outputs, n=2)
    assert outputs[0].error == "agent timed out after 120 s"
    assert outputs[1].reward == 1.5


def _agentic(tmp_path, *extra):
    return load_config(
        None,
        [
            "model.preset=tiny",
            "data.task=terminal",
            "data.num_prompts=8",
            "rollout.engine=server",
            "rollout.prompts_per_step=2",
            "rollout.n_samples_per_prompt=2",
            "weight_sync.transport=shared_memory",
            "agent.function=miles_core.envs.sandbox_agent:run_agent",
            "train.global_batch_size=4",
            "train.micro_batch_size=4",
            f"checkpoint.root={tmp_path}/ckpt",
            *extra,
        ],
    )


def test_reward_hook_paths_are_checked_before_anything_starts(tmp_path):
    preflight(_agentic(tmp_path, "agent.reward_function=test_rewards:length_bonus"))
    for setting, message in (
        ("agent.reward_function=test_rewards:nope", "has no 'nope'"),
        (
            "agent.group_reward_function=no_such_module:f",
            "cannot import agent.group_reward_function 'no_such_module:f': no module 'no_such_module'",
        ),
        ("agent.reward_function=test_rewards", "expected 'package.module:name'"),
    ):
        with pytest.raises(ValueError, match=message):
            preflight(_agentic(tmp_path, setting))


def test_agent_settings_that_cannot_work_together_are_refused(tmp_path):
    for settings, message in (
        (["agent.eval_episodes=4", "data.path=rows.jsonl"], "with data.path set there is none"),
        (["agent.eval_every=5"], "agent.eval_every needs agent.eval_episodes"),
        (["agent.eval_samples=4"], "agent.eval_samples needs agent.eval_episodes"),
        (["agent.eval_episodes=4", "agent.eval_samples=17"], "less than or equal to 16"),
        (["agent.command=[python,x.py]"], "agent.command and agent.function: miles_core"),
        (
            ["agent.function=miles_core.agents.blackbox:run_command"],
            "agent.command and agent.function",
        ),
    ):
        with pytest.raises(ValueError, match=message):
            _agentic(tmp_path, *settings)


def test_agent_settings_without_an_agent_function_are_refused(tmp_path):
    with pytest.raises(ValueError, match="agent.reward_function, agent.eval_episodes needs agent"):
        load_config(
            None,
            ["agent.reward_function=test_rewards:length_bonus", "agent.eval_episodes=4"],
        )


def _second_attempt_raises(episode: Episode) -> float:
    if episode.samples[0].rollout_id.endswith("-1"):
        raise RuntimeError("judge unavailable")
    return 0.5


def test_the_rollout_masks_the_episodes_a_hook_failed_and_trains_the_rest(tmp_path):
    """AgenticRollout with a stand-in generate function (one leaf per episode, env reward 1.0)
    and a session server stand-in that only answers /metrics (real HTTP)."""
    from fastapi import FastAPI

    from miles_core.agents.layers import RolloutInput, RolloutSetup
    from miles_core.agents.rollout import AgenticRollout
    from miles_core.data import TASKS
    from miles_core.data.dataset import PromptSource
    from miles_core.types import Status

    counters = FastAPI()

    @counters.get("/metrics")
    async def metrics():
        return {"tito_token_edits": 0, "branches": 0}

    async def generate(inp):
        return GenerateOutput([_sample(inp.rollout_id)], 1.0, {"turns": 1.0})

    cfg = _agentic(tmp_path)
    source = PromptSource(TASKS.get("terminal").generate(4, seed=0))
    hooks = RewardHooks(_second_attempt_raises, None, timeout_s=5)
    with _Server(counters) as url:
        setup = RolloutSetup(cfg, source, url.removesuffix("/v1"), generate, hooks)
        out = asyncio.run(AgenticRollout(setup)(RolloutInput(step=0, weight_version=0)))
    samples = [s for g in out.groups for s in g.samples]
    assert [s.rollout_id for s in samples] == ["s0-g0-0", "s0-g0-1", "s0-g1-0", "s0-g1-1"]
    for s in samples:
        if s.rollout_id.endswith("-1"):
            assert s.status == Status.FAILED and s.reward == 0.0 and not any(s.loss_mask)
            assert "judge unavailable" in s.metadata["error"]
        else:
            assert s.reward == 0.5 and any(s.loss_mask)
    assert out.metrics["rollout/reward_hook_failures"] == 2.0
    assert out.metrics["rollout/failed_episodes"] == 2.0
    assert out.metrics["rollout/success_rate"] == 0.5  # the environment's grade: 1, 0, 1, 0
    assert out.metrics["rollout/episode_reward_mean"] == 0.25  # trained on: 0.5, 0, 0.5, 0
