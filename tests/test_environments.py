"""Environments are a protocol: a task family of a user's own (tests/plugins/file_moves.py,
nothing of the terminal suite) runs through the tool-using agent loop and the SFT
demonstrations unchanged; sandbox limits come from the config; the outer rollout function loads
by import path; the session token budget caps and ends episodes."""

import asyncio

import httpx
import pytest
from fastapi import FastAPI
from test_agents import _scripted_reply, _Server

from miles_core.agents.layers import PluginError, load_rollout_function
from miles_core.agents.rollout import AgenticRollout
from miles_core.config import load_config
from miles_core.envs.environment import load_environment
from miles_core.envs.sandbox_agent import run_agent
from miles_core.rollout.sources import episode_metadata
from tests.plugins.family import HeadersFamily
from tests.plugins.file_moves import TASKS

USER_TASK = "tests.plugins.file_moves:TASKS"


def _config(*extra):
    return load_config(
        None,
        [
            f"data.task={USER_TASK}",
            "rollout.engine=server",
            "weight_sync.transport=shared_memory",
            "agent.function=miles_core.envs.sandbox_agent:run_agent",
            *extra,
        ],
    )


def _episode(example, metadata, policy: dict[str, list[str]]) -> tuple[dict, list[str]]:
    """run_agent against a scripted policy; (its result, the tool results the policy saw)."""
    seen: list[str] = []
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(body: dict):
        seen[:] = [m["content"] for m in body["messages"] if m["role"] == "tool"]
        return _scripted_reply(policy, body)

    with _Server(app) as url:
        prompt = [{"role": "user", "content": example.prompt}]
        return asyncio.run(run_agent(url, prompt, {}, metadata)), seen


def test_a_users_own_environment_runs_through_the_agent_and_the_demonstrations():
    train, evaluation = TASKS.generate(4, seed=0), TASKS.evaluation(4, seed=0)
    assert {ex.label["kind"] for ex in train} == {"move"}  # copy is held out for evaluation
    assert {ex.label["kind"] for ex in evaluation} == {"move", "copy"}
    example = train[0]
    env = TASKS.environment_of(example.label)
    metadata = {"task": example.label} | episode_metadata(_config(), TASKS)
    assert metadata["environment"] == "tests.plugins.file_moves:FileMove"
    assert metadata["limits"] == {"cpu_s": 2}  # the task's own limits
    solved, _ = _episode(example, metadata, {example.prompt: env.solution})
    assert solved["reward"] == 1.0 and solved["metrics"]["commands"] == 1.0
    copied = [env.solution[0].replace("mv ", "cp ")]  # the source is left behind: not a move
    assert _episode(example, metadata, {example.prompt: copied})[0]["reward"] == 0.0
    family = HeadersFamily()
    ids, mask = TASKS.demonstration(example, family)  # rendered with the run's family
    opening = family.prompt([{"role": "user", "content": example.prompt}])
    assert ids[: len(opening)] == opening and len(ids) - len(opening) == len(mask)
    assert family.decode(ids).count("### Assistant\n") == 2  # the run call, then "done"
    assert env.solution[0] in family.decode(ids)


def test_sandbox_limits_from_the_config_bound_every_command():
    example = TASKS.generate(1, seed=1)[0]
    config = _config("agent.sandbox.wall_s=0.5", "agent.sandbox.cpu_s=3")
    metadata = {"task": example.label} | episode_metadata(config, TASKS)
    assert metadata["limits"] == {"cpu_s": 3, "wall_s": 0.5}  # the config wins, per field
    slow = [f"sleep 30; {TASKS.environment_of(example.label).solution[0]}"]
    out, seen = _episode(example, metadata, {example.prompt: slow})
    assert out["reward"] == 0.0 and seen == ["[killed: wall time]"]


def test_environment_and_rollout_function_paths_are_checked():
    with pytest.raises(ValueError, match="must be a class with setup, check, to_dict"):
        load_environment("miles_core.envs.terminal:make_task")
    with pytest.raises(ValueError, match="metadata has no 'environment'"):
        asyncio.run(run_agent("http://127.0.0.1:1/v1", [], {}, {"task": {}}))
    assert load_rollout_function(None, ("__call__", "group")) is AgenticRollout
    with pytest.raises(PluginError, match="has no group, which this run calls"):
        load_rollout_function("tests.plugins.file_moves:FileMove", ("group",))
    with pytest.raises(PluginError, match="must be a class"):
        load_rollout_function("tests.plugins.file_moves:make", ("group",))
    with pytest.raises(ValueError, match="agent.rollout_function needs agent.function"):
        load_config(None, ["agent.rollout_function=x.y:Z"])


def test_the_session_token_budget_caps_each_call_and_ends_a_full_conversation(session_stack):
    from fastapi.testclient import TestClient

    from miles_core.sessions.server import create_app
    from miles_core.tito import FAMILIES

    family = FAMILIES.get("tiny")()
    app = create_app(session_stack[0].url, family, token_budget=60)
    with TestClient(app) as http:
        sid = http.post("/sessions", json={}).json()["session_id"]
        prompt = [{"role": "user", "content": "say a"}]
        body = {"model": "m", "messages": prompt, "max_tokens": 500, "seed": 0}
        r = http.post(f"/sessions/{sid}/v1/chat/completions", json=body)
        used = len(family.prompt(prompt))
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 60 - used
        long = [{"role": "user", "content": "a" * 80}]  # past the budget before any reply
        r = http.post(f"/sessions/{sid}/v1/chat/completions", json=body | {"messages": long})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_a_new_familys_broken_tool_call_is_a_bad_call_and_loses_the_shaped_reward():
    """The headers family (tests/plugins/family.py) writes tool calls as `[[call]]…[[/call]]`,
    markup of its own. Behind a session server of that family, a scripted engine answers with
    the solving call, then with a call in that markup that does not parse: the session server
    says so (`miles.broken_tool_call`), the agent counts it in `bad_calls`, and `well_formed`
    zeroes the solved episode (its raw grade stays 1)."""
    import json

    from miles_core.agents.rewards import Episode
    from miles_core.envs.shaping import well_formed
    from miles_core.sessions.server import create_app
    from tests.servers import served

    family = HeadersFamily()
    example = TASKS.generate(1, seed=0)[0]
    env = TASKS.environment_of(example.label)
    run = {"name": "run", "arguments": json.dumps({"cmd": env.solution[0]})}
    replies = [
        family.completion({"role": "assistant", "tool_calls": [{"function": run}]}),
        family.completion({"role": "assistant", "content": '[[call]]{"name": "run", x}[[/call]]'}),
    ]
    engine = FastAPI()

    @engine.post("/generate")
    async def generate(body: dict):
        ids = replies.pop(0)
        return {
            "output_ids": ids,
            "meta_info": {
                "finish_reason": {"type": "stop"},
                "prompt_tokens": len(body["input_ids"]),
                "completion_tokens": len(ids),
                "weight_version": "1",
                "output_token_logprobs": [[-0.5, t, None] for t in ids],
            },
        }

    metadata = {"task": example.label} | episode_metadata(_config(), TASKS)
    with served(engine) as engine_url, served(create_app(engine_url, family)) as sessions:
        sid = httpx.post(f"{sessions}/sessions").json()["session_id"]
        prompt = [{"role": "user", "content": example.prompt}]
        out = asyncio.run(run_agent(f"{sessions}/sessions/{sid}/v1", prompt, {}, metadata))
        broken = httpx.get(f"{sessions}/metrics").json()["broken_tool_calls"]
    assert replies == [] and broken == 1
    assert out["reward"] == 1.0 and out["metrics"]["commands"] == 1.0
    assert out["metrics"]["bad_calls"] == 1.0
    episode = Episode([], example.label, out["reward"], out["metrics"], out["reward"])
    assert well_formed(episode) == 0.0
