"""Agent layers: the terminal agent against a scripted OpenAI-compatible policy (real HTTP on
127.0.0.1) solves every task kind in its sandbox; through the session server and a real engine
the episode's turns come back as samples with the environment's reward; failing and hanging
agents yield FAILED samples; plug-ins load by import path or are refused clearly."""

import asyncio
import functools
import json
import random
import threading
import time
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI

from miles_core.agents.layers import GenerateInput, PluginError, load_plugin
from miles_core.agents.session_generate import session_generate
from miles_core.envs.environment import environment_path
from miles_core.envs.sandbox_agent import run_agent
from miles_core.envs.terminal import HELD_OUT_KINDS, KINDS, make_task, make_tasks
from miles_core.processes.managed import free_port
from miles_core.types import Status

REPO = Path(__file__).resolve().parents[1]


def _meta(task, **more) -> dict:
    return {"task": task.to_dict(), "environment": environment_path(type(task))} | more


def _scripted_reply(
    solutions: dict[str, list[str]], body: dict, bad_args: bool = False, final=("done", "stop")
) -> dict:
    """Answers like a model that knows each task's solution: one `run` call per command, then
    a final message (`final`: its content and finish reason)."""
    messages = body["messages"]
    instruction = messages[0]["content"]
    done = sum(1 for m in messages if m["role"] == "tool")
    steps = solutions[instruction]
    if done < len(steps):
        args = "not json" if bad_args else json.dumps({"cmd": steps[done]})
        message = {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": f"call_{done}",
                    "type": "function",
                    "function": {"name": "run", "arguments": args},
                }
            ],
        }
        reason = "tool_calls"
    else:
        message, reason = {"role": "assistant", "content": final[0]}, final[1]
    return {
        "id": "x",
        "object": "chat.completion",
        "created": 0,
        "model": "scripted",
        "choices": [{"index": 0, "message": message, "finish_reason": reason}],
        # what a session server of the tiny family says of such a reply (sessions/server.py)
        "miles": {"broken_tool_call": _tiny().broken_tool_call(message)},
    }


@functools.cache
def _tiny():
    from miles_core.tito import FAMILIES

    return FAMILIES.get("tiny")()


def _scripted_policy(
    solutions: dict[str, list[str]], bad_args: bool = False, final=("done", "stop")
) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(body: dict):
        return _scripted_reply(solutions, body, bad_args, final)

    return app


class _Server:
    """uvicorn on 127.0.0.1 in a thread, stopped in teardown."""

    def __init__(self, app: FastAPI):
        self.port = free_port()
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "scripted policy server did not start"
            time.sleep(0.01)
        return f"http://127.0.0.1:{self.port}/v1"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def counts(out: dict) -> dict:
    """An episode's counters, without where its time went (`model_s`, `sandbox_s`: checked to be
    there and positive)."""
    metrics = dict(out["metrics"])
    model_s, sandbox_s = metrics.pop("model_s"), metrics.pop("sandbox_s")
    assert model_s > 0 and sandbox_s > 0, (model_s, sandbox_s)
    return metrics


def test_the_sandbox_agent_solves_every_kind_with_a_policy_that_knows_the_solutions():
    tasks = make_tasks(len(KINDS), seed=3, kinds=KINDS)
    assert {t.kind for t in tasks} == set(KINDS)
    for task in tasks:
        app = _scripted_policy({task.instruction: task.solution})
        with _Server(app) as base_url:
            prompt = [{"role": "user", "content": task.instruction}]
            meta = _meta(task, max_turns=len(task.solution) + 1)
            t = time.perf_counter()
            out = asyncio.run(run_agent(base_url, prompt, {}, meta))
            wall = time.perf_counter() - t
        assert out["reward"] == 1.0, task
        assert out["metrics"]["model_s"] + out["metrics"]["sandbox_s"] <= wall
        steps = float(len(task.solution))  # one call per command, then the final answer
        expected = {"turns": steps + 1, "commands": steps, "bad_calls": 0.0, "context_full": 0.0}
        assert counts(out) == expected | {"truncated": 0.0}


def test_detours_take_turns_that_turn_slack_does_not_leave():
    """`terminal_detours` demonstrates each task after 0, 1 or 2 detours (fixed per example);
    `agent.turn_slack: 0` gives an episode as many calls as the script has commands, so the
    same policy solves a `fix` task directly and fails it after a detour; without a slack,
    `agent.max_turns` alone limits it."""
    from miles_core.config import load_config
    from miles_core.data import TASKS
    from miles_core.rollout.sources import episode_metadata
    from miles_core.tito import FAMILIES

    task = TASKS.get("terminal_detours")
    examples = task.generate(24, seed=0)
    taken = [task.detours_of(ex) for ex in examples]
    assert set(taken) == {0, 1, 2} and taken == [task.detours_of(ex) for ex in examples]
    family = FAMILIES.get("tiny")()
    for ex in examples[:8]:  # every demonstration still solves its task (or raises)
        ids, _ = task.demonstration(ex, family)
        calls = family.decode(ids).count('"cmd"')
        assert calls == len(ex.label["solution"]) + task.detours_of(ex)
        assert ('"ls"' in family.decode(ids)) == (task.detours_of(ex) > 0)

    fix = make_task("fix", random.Random(0))
    config = load_config(
        None,
        [
            "data.task=terminal",
            "rollout.engine=server",
            "weight_sync.transport=shared_memory",
            "agent.function=miles_core.envs.sandbox_agent:run_agent",
            "agent.max_turns=8",
            "agent.turn_slack=0",
        ],
    )
    meta = episode_metadata(config, TASKS.get("terminal"))
    assert meta["turn_slack"] == 0
    prompt = [{"role": "user", "content": fix.instruction}]
    for policy, slack, reward, turns in [
        (fix.solution, 0, 1.0, 2.0),  # cat, sed: the limit is reached, the workspace graded
        (["ls", *fix.solution], 0, 0.0, 2.0),  # ls, cat: no call left for the edit
        (["ls", *fix.solution], None, 1.0, 4.0),  # ls, cat, sed, done
    ]:
        with _Server(_scripted_policy({fix.instruction: policy})) as url:
            extra = {"turn_slack": slack} if slack is not None else {}
            out = asyncio.run(run_agent(url, prompt, {}, _meta(fix, max_turns=8, **extra)))
        assert (out["reward"], out["metrics"]["turns"]) == (reward, turns), (policy, slack)


def test_a_conversation_out_of_context_ends_the_episode_and_is_graded():
    """The session server answers 400 when the next turn does not fit the context: the agent
    stops there and the checker grades what was done (here: the task, solved in turn one)."""
    from fastapi.responses import JSONResponse

    task = make_task("create", random.Random(0))
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(body: dict):
        if any(m["role"] == "tool" for m in body["messages"]):
            message = "prompt (500 tokens) + max_new_tokens (128) exceeds the context length 512"
            return JSONResponse({"error": {"message": message}}, status_code=400)
        return _scripted_reply({task.instruction: task.solution}, body)

    with _Server(app) as url:
        prompt = [{"role": "user", "content": task.instruction}]
        out = asyncio.run(run_agent(url, prompt, {}, _meta(task)))
    assert out["reward"] == 1.0
    assert counts(out) == {
        "turns": 1.0,
        "commands": 1.0,
        "bad_calls": 0.0,
        "truncated": 0.0,
        "context_full": 1.0,
    }


def test_bad_tool_calls_and_escapes_score_zero_without_stopping_anything():
    task = make_task("create", random.Random(0))
    with _Server(_scripted_policy({task.instruction: task.solution}, bad_args=True)) as url:
        prompt = [{"role": "user", "content": task.instruction}]
        out = asyncio.run(run_agent(url, prompt, {}, _meta(task, max_turns=2)))
    assert out["reward"] == 0.0  # the call was answered with an error, nothing ran
    assert counts(out) == {
        "turns": 2.0,
        "commands": 0.0,
        "bad_calls": 1.0,
        "truncated": 0.0,
        "context_full": 0.0,
    }
    escape = [
        "rm -rf /usr; echo x > /etc/evil; cat /root/.bashrc > a.txt; ln -sf /etc/passwd "
        + task.checks[0]["file"]
    ]
    with _Server(_scripted_policy({task.instruction: escape})) as url:
        out = asyncio.run(run_agent(url, prompt, {}, _meta(task)))
    assert out["reward"] == 0.0 and out["metrics"]["commands"] == 1.0


def test_broken_replies_after_a_solution_keep_the_grade_and_lose_the_shaped_reward():
    """The task is solved by its command; then the last reply is a tool call that did not parse
    (plain text holding the family's call markup, which the session server reports), or is cut off at max_tokens, or is a clean answer. The raw
    grade is 1 each time; `well_formed` keeps it only for the clean one."""
    from miles_core.agents.rewards import Episode
    from miles_core.envs.shaping import well_formed

    task = make_task("create", random.Random(0))
    prompt = [{"role": "user", "content": task.instruction}]
    broken = '<tool_call>\n{"name": "run", "argumenenenen": x}\n</tool_call>'
    cases = [((broken, "stop"), "bad_calls", 0.0), (("don", "length"), "truncated", 0.0)]
    for final, key, shaped in [*cases, (("done", "stop"), None, 1.0)]:
        with _Server(_scripted_policy({task.instruction: task.solution}, final=final)) as url:
            out = asyncio.run(run_agent(url, prompt, {}, _meta(task)))
        assert out["reward"] == 1.0 and out["metrics"]["commands"] == 1.0
        assert {k for k in ("bad_calls", "truncated") if out["metrics"][k]} == (
            {key} if key else set()
        )
        episode = Episode([], task.to_dict(), out["reward"], out["metrics"], out["reward"])
        assert well_formed(episode) == shaped


@pytest.fixture(scope="module")
def sessions(session_stack):
    return session_stack[1].url


def _input(url: str, task, rollout_id: str = "r0") -> GenerateInput:
    return GenerateInput(
        prompt=[{"role": "user", "content": task.instruction}],
        metadata=_meta(task, max_turns=3),
        request_kwargs={"max_tokens": 24, "seed": 1},
        rollout_id=rollout_id,
        session_url=url,
    )


def test_an_episode_through_the_session_server_becomes_samples_with_the_env_reward(sessions):
    task = make_tasks(3, seed=1)[2]
    out = asyncio.run(session_generate(_input(sessions, task), run_agent))
    assert out.error is None and out.reward == 0.0  # a random model does not solve it
    assert out.samples and all(s.rollout_id == "r0" and s.reward == 0.0 for s in out.samples)
    for s in out.samples:
        s.validate()
        assert sum(s.loss_mask) > 0 and s.status in (Status.COMPLETED, Status.TRUNCATED)
    assert out.metrics["turns"] >= 1


def test_an_agent_that_raises_or_hangs_yields_failed_samples(sessions):
    task = make_tasks(1, seed=2)[0]

    async def crashes(base_url, prompt, request_kwargs, metadata):
        await run_agent(base_url, prompt, {**request_kwargs, "max_tokens": 4}, metadata)
        raise RuntimeError("tool server went away")

    async def hangs(base_url, prompt, request_kwargs, metadata):
        await asyncio.sleep(60)

    out = asyncio.run(session_generate(_input(sessions, task, "r1"), crashes))
    assert "tool server went away" in out.error
    assert out.samples and all(s.status == Status.FAILED for s in out.samples)
    out = asyncio.run(session_generate(_input(sessions, task, "r2"), hangs, timeout_s=0.5))
    assert "timed out" in out.error and out.samples == []


def test_plugins_load_by_import_path_or_are_refused_clearly():
    assert load_plugin("miles_core.envs.sandbox_agent:run_agent", "agent") is run_agent
    cases = [
        ("no_colon", "expected 'package.module:name'"),
        ("miles_core.nope:x", "cannot import"),
        ("miles_core.envs.sandbox_agent:missing", "has no 'missing'"),
        ("miles_core.envs.terminal:make_task", "must be an async function"),
    ]
    for path, words in cases:
        with pytest.raises(PluginError, match=words):
            load_plugin(path, "agent function")


def test_the_checker_cannot_be_gamed_by_editing_the_test():
    task = make_task("fix", random.Random(1))
    cheat = ["echo 'pass' > test_calc.py"]  # a rewritten test would pass trivially
    with _Server(_scripted_policy({task.instruction: cheat})) as url:
        prompt = [{"role": "user", "content": task.instruction}]
        out = asyncio.run(run_agent(url, prompt, {}, _meta(task)))
    assert out["reward"] == 0.0 and out["metrics"]["commands"] == 1.0


def test_an_agent_metric_reported_by_some_episodes_says_how_many_it_averages():
    from miles_core.agents.layers import GenerateOutput
    from miles_core.agents.rollout import episode_metrics
    from miles_core.data.tasks import Example

    outputs = [
        GenerateOutput([], reward=1.0, metrics={"turns": 2.0, "bad_calls": 1.0}),
        GenerateOutput([], reward=0.0, metrics={"turns": 4.0}),
        GenerateOutput([], error="timed out", metrics={"turns": 6.0}),  # failed: still counted
        GenerateOutput([], reward=1.0),  # reported nothing
    ]
    out = episode_metrics("rollout", [Example(prompt="p", label=None)] * 4, outputs)
    assert (out["agent/turns_mean"], out["agent/turns_episodes"]) == (4.0, 3.0)
    assert (out["agent/bad_calls_mean"], out["agent/bad_calls_episodes"]) == (1.0, 1.0)
    ev = episode_metrics("eval", [Example(prompt="p", label=None)] * 4, outputs)
    assert ev["eval/agent/turns_episodes"] == 3.0


def test_the_agentic_evaluation_set_holds_no_training_task():
    """examples/agentic_async_cpu.yaml's sizes: its RL prompts and SFT examples, then its
    evaluation tasks (at the earlier seed-only draw, 63 of 96 were training tasks): none is a
    training task of either phase, none repeats, every kind is there, the held-out composition
    only there, and the draw is the same every time."""
    from miles_core.config import load_config
    from miles_core.data import TASKS, load_examples, rl_examples
    from miles_core.data.held_out import EVAL_SEED_OFFSET, example_key, held_out, trained_on

    config = load_config(REPO / "examples/agentic_async_cpu.yaml")
    d, n = config.data, config.agent.eval_episodes
    task = TASKS.get(d.task)
    rows = rl_examples(config)
    training = trained_on(config, rows)
    assert len(training) == d.num_prompts + config.sft.num_examples
    # data.exclude_sft: the RL prompts are none of the SFT examples (a plain draw holds some)
    sft_keys = {example_key(ex) for ex in training[len(rows) :]}
    assert d.exclude_sft and not {example_key(ex) for ex in rows} & sft_keys
    assert {example_key(ex) for ex in load_examples(d.task, None, d.num_prompts, d.seed)} & sft_keys
    evaluation = held_out(task, n, d.seed + EVAL_SEED_OFFSET, training, "agent.eval_episodes")
    keys = [example_key(ex) for ex in evaluation]
    assert len(set(keys)) == n and not set(keys) & {example_key(ex) for ex in training}
    assert {ex.label["kind"] for ex in evaluation} == set(KINDS)
    assert not set(HELD_OUT_KINDS) & {ex.label["kind"] for ex in training}
    # without the SFT examples, some evaluation tasks would be ones the warm start trained on
    alone = held_out(task, n, d.seed + EVAL_SEED_OFFSET, rows, "x")
    assert {example_key(ex) for ex in alone} & sft_keys
    assert held_out(task, n, d.seed + EVAL_SEED_OFFSET, training, "x") == evaluation
